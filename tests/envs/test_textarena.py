"""TextArena games as they are (`rollout.multi_turn.env: textarena`): the real `textarena` package's
GuessTheNumber, played by the adapter and trained on by the loop."""

import json

import pytest

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


def test_an_unknown_game_is_one_line_at_start():
    overrides = ["rollout.multi_turn.env=textarena", "rollout.multi_turn.env_kwargs={env_id: GuessTheNumbr-v0}"]
    with pytest.raises(ConfigError, match="TextArena has no game 'GuessTheNumbr-v0'"):
        load_config(None, overrides)  # the config's own checks, before any engine


def test_three_training_steps_on_a_textarena_game(tmp_path):
    """The loop plays GuessTheNumber (HF engine, a tiny chat model, real DeepSpeed engines): episodes
    take several turns with the game's hints as environment tokens, rows are token-exact, the
    trainer's logprobs are the engine's, and the reward is the game's (invalid-move or win rewards)."""
    from verl_ds.data.tiny import build_chat_tokenizer, build_tiny_llama
    from verl_ds.diagnostics.observers import TrainerObserver
    from verl_ds.trainer.rl_trainer import RLTrainer

    shape = dict(hidden=64, layers=2, heads=2, ffn=128, max_len=1024)  # the game's rules are ~450 characters
    model = build_tiny_llama(tmp_path / "m", build_chat_tokenizer(), **shape)
    data = tmp_path / "games.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Let's play.", "answer": "", "seed": s}) + "\n" for s in range(16)))
    cfg = load_config(
        None,
        [
            f"model.path={model}",
            "data.task=files",
            f"data.train_files=[{data}]",
            "data.apply_chat_template=true",
            "data.reward_fn=none",
            "rollout.engine=hf",
            "rollout.multi_turn.env=textarena",
            "rollout.multi_turn.env_kwargs={env_id: GuessTheNumber-v0}",
            "rollout.multi_turn.max_turns=3",
            "rollout.max_new_tokens=64",  # the random model ends ~half its turns with eos within 64
            "rollout.max_model_len=1024",
            "rollout.n=4",
            "trainer.prompts_per_step=4",
            "trainer.steps=3",
            "trainer.val_before_train=false",
            "roles.actor.micro_batch_size=16",
            "roles.reference.micro_batch_size=16",
            *[f"precision.{k}_dtype=fp32" for k in ("actor", "reference", "rollout", "buffer")],
            f"trainer.run_dir={tmp_path / 'run'}",
            "logging.wandb.mode=disabled",
        ],
    )
    texts = []

    class Rows(TrainerObserver):
        def on_rollout(self, trainer, rollout, scores):
            texts.extend(trainer.tokenizer.batch_decode(rollout.batch.response_ids))

    with RLTrainer(cfg) as trainer:
        trainer.observers.append(Rows())
        steps = [trainer.step() for _ in range(3)]
    for m in steps:
        assert m["multi_turn/token_mismatch_fraction"] == 0.0 and m["env/failures"] == 0.0
        assert m["rollout_corr/logprob_abs_diff_max"] <= 1e-5
        assert 0.0 <= m["reward/mean"] <= 1.0
    assert max(m["multi_turn/turns/max"] for m in steps) >= 2
    # the game's own answers to the model's turns are in the rows, as environment tokens
    assert any("<|im_start|>user\nYou attempted an invalid move" in t or "The target number is" in t for t in texts)
