"""TextArena games as they are (`rollout.multi_turn.env: textarena`): the real `textarena` package's
GuessTheNumber, played by the adapter and trained on by the loop."""

import pytest

from tests.envs.helpers import check_steps, train_on
from verl_ds.config import load_config
from verl_ds.envs.textarena import TextArenaEnv
from verl_ds.errors import ConfigError


def _play(env, seed):
    """Binary search on the game's own hints: (guesses, final reward)."""
    first = env.reset({"prompt": "play", "seed": seed})
    assert "Guess The Number" in first and "[5]" in first  # the game's own rules open the conversation
    lo, hi, guesses = 1, 20, []
    while True:
        g = (lo + hi) // 2
        guesses.append(g)
        obs, reward, done, info = env.step(f"My guess: [{g}]")
        if done:
            return guesses, reward, info
        assert obs in ("The target number is higher.", "The target number is lower."), obs  # only what is new
        lo, hi = (g + 1, hi) if "higher" in obs else (lo, g - 1)


def test_a_game_is_played_by_its_own_rules_and_seeded_by_the_example():
    env = TextArenaEnv("GuessTheNumber-v0")
    guesses, reward, info = _play(env, seed=3)
    assert reward == 1.0 and info["invalid_move"] == 0.0
    assert _play(TextArenaEnv("GuessTheNumber-v0"), seed=3)[0] == guesses  # the same seed, the same number
    env.reset({"prompt": "play", "seed": 3})
    obs, reward, done, _ = env.step("no brackets")
    assert "invalid move" in obs.lower() and not done  # the game's own complaint, as the next message


def _repeat_a_wrong_guess(env, seed):
    """Guess a wrong number, then repeat it (an invalid move) until the game ends: the final reward."""
    env.reset({"prompt": "play", "seed": seed})
    wrong = next(g for g in range(1, 9) if env.env.state.game_state["game_number"] != g)
    done = False
    while not done:
        _, reward, done, info = env.step(f"[{wrong}]")
    assert info["invalid_move"] == 1.0
    return reward


def test_an_invalid_move_scores_the_games_partial_credit_or_the_configured_reward():
    """TextArena ends a game on repeated invalid moves with its partial credit (GuessTheNumber: the
    closeness of the last valid guess), which a policy can farm by repeating its first guess;
    `invalid_move_reward` replaces it."""
    game = {"min_number": 1, "max_number": 8, "max_turns": 4}
    assert _repeat_a_wrong_guess(TextArenaEnv("GuessTheNumber-v0", game), seed=5) > 0.0
    assert _repeat_a_wrong_guess(TextArenaEnv("GuessTheNumber-v0", game, invalid_move_reward=0.0), seed=5) == 0.0


def test_an_unknown_game_is_one_line_at_start():
    overrides = ["rollout.multi_turn.env=textarena", "rollout.multi_turn.env_kwargs={env_id: GuessTheNumbr-v0}"]
    with pytest.raises(ConfigError, match="TextArena has no game 'GuessTheNumbr-v0'"):
        load_config(None, overrides)  # the config's own checks, before any engine


def test_three_training_steps_on_a_textarena_game(tmp_path):
    """The loop plays GuessTheNumber (HF engine, a tiny chat model, real DeepSpeed engines): episodes
    take several turns with the game's hints as environment tokens, rows are token-exact, the
    trainer's logprobs are the engine's, and the reward is the game's (invalid-move or win rewards)."""
    # the game's rules are ~450 characters; the random model ends ~half its turns with eos within 64
    steps, texts = train_on(tmp_path, "textarena", "{env_id: GuessTheNumber-v0}", max_new_tokens=64, max_len=1024)
    check_steps(steps)
    # the game's own answers to the model's turns are in the rows, as environment tokens
    assert any("<|im_start|>user\nYou attempted an invalid move" in t or "The target number is" in t for t in texts)
