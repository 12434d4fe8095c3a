"""Three training steps of the loop on an environment (HF engine, a tiny chat model, real DeepSpeed
engines, fp32), with every rollout's rows decoded: what the environment-adapter tests share."""

import json

from verl_ds.config import load_config

STEPS = 3


def train_on(tmp_path, env: str, env_kwargs: str, max_new_tokens: int, max_len: int = 256):
    """(each step's metrics, every training rollout's rows as text) for `rollout.multi_turn.env`
    `env` with `env_kwargs` (YAML), on data rows that carry game seeds 0..15."""
    from verl_ds.data.tiny import build_chat_tokenizer, build_tiny_llama
    from verl_ds.diagnostics.observers import TrainerObserver
    from verl_ds.trainer.rl_trainer import RLTrainer

    shape = dict(hidden=64, layers=2, heads=2, ffn=128, max_len=max_len)
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
            f"rollout.multi_turn.env={env}",
            f"rollout.multi_turn.env_kwargs={env_kwargs}",
            "rollout.multi_turn.max_turns=3",
            f"rollout.max_new_tokens={max_new_tokens}",
            f"rollout.max_model_len={max_len}",
            "rollout.n=4",
            "trainer.prompts_per_step=4",
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
        steps = [trainer.step() for _ in range(STEPS)]
    return steps, texts


def check_steps(steps) -> None:
    """Token-exact rows, no environment failure, the trainer's logprobs the engine's, a reward in
    the game's [0, 1], and episodes of more than one turn."""
    for m in steps:
        assert m["multi_turn/token_mismatch_fraction"] == 0.0 and m["env/failures"] == 0.0
        assert m["rollout_corr/logprob_abs_diff_max"] <= 1e-5
        assert 0.0 <= m["reward/mean"] <= 1.0
    assert max(m["multi_turn/turns/max"] for m in steps) >= 2
