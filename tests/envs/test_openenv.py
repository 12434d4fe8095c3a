"""OpenEnv environments as they are (`rollout.multi_turn.env: openenv`): a class written against
the real `openenv-core`, served by OpenEnv's own server on 127.0.0.1 and reached through its own
client, played by the adapter and trained on by the loop."""

from urllib.parse import urlparse

import pytest

from tests.envs.helpers import check_steps, train_on
from verl_ds.config import load_config
from verl_ds.envs.openenv import OpenEnvEnv
from verl_ds.errors import ConfigError

GAME = dict(
    serve="tests.envs.openenv_game:GuessNumber",
    action="tests.envs.openenv_game:GuessAction",
    observation="tests.envs.openenv_game:GuessObservation",
)


def _play(seed):
    env = OpenEnvEnv(**GAME)
    assert urlparse(env.base_url).hostname == "127.0.0.1"
    assert env.reset({"prompt": "p", "seed": seed}) == "Guess my number (1-9)."
    lo, hi, guesses = 1, 9, []
    while True:
        g = (lo + hi) // 2
        guesses.append(g)
        obs, reward, done, _ = env.step(f"I say {g}")
        if done:
            return guesses, reward, env
        lo, hi = (g + 1, hi) if obs == "higher" else (lo, g - 1)


def test_an_openenv_environment_is_served_by_openenv_and_played_by_its_rules():
    guesses, reward, env = _play(seed=5)
    assert reward == 1.0 and env.client is None  # the session ended at done
    assert _play(seed=5)[0] == guesses  # seeded by the example
    # concurrent sessions on the one server: two episodes interleaved keep their own state
    a, b = OpenEnvEnv(**GAME), OpenEnvEnv(**GAME)
    assert a.base_url == b.base_url
    a.reset({"prompt": "p", "seed": 1}), b.reset({"prompt": "p", "seed": 2})
    assert a.step("no digits") == ("No number there.", 0.0, False, {})
    assert b.step("9")[0] in ("lower", "Right!")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ("{serve: tests.envs.openenv_game:GuessNumber}", "needs its action class too"),
        ("{base_url: 'http://10.0.0.1:8000'}", "only loopback"),
        (
            "{serve: tests.envs.openenv_game:GuessAction, action: tests.envs.openenv_game:GuessAction, "
            "observation: tests.envs.openenv_game:GuessObservation}",
            "is not an OpenEnv Environment class",
        ),
    ],
)
def test_a_bad_openenv_setting_is_one_line_at_start(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["rollout.multi_turn.env=openenv", f"rollout.multi_turn.env_kwargs={kwargs}"])


def test_three_training_steps_on_an_openenv_environment(tmp_path):
    """The loop plays the OpenEnv game (HF engine, tiny chat model, real DeepSpeed engines): rows are
    token-exact with the game's answers as environment tokens, the trainer's logprobs are the
    engine's, the reward is the game's."""
    kwargs = "{" + ", ".join(f"{k}: {v}" for k, v in GAME.items()) + "}"
    # the random model ends about 40% of its turns with eos within 48 tokens
    steps, texts = train_on(tmp_path, "openenv", kwargs, max_new_tokens=48)
    check_steps(steps)
    answers = ("<|im_start|>user\nNo number there.", "<|im_start|>user\nhigher", "<|im_start|>user\nlower")
    assert any(a in t for t in texts for a in answers)  # the game's own answers, as environment tokens
