"""A long-row job for the tiny quickstart model: prompts of ~1.5k characters (the char tokenizer: a
token each), 4 prompts x 4 samples a step, and a reward that varies within every group so each step
trains (lengths: `long_row_reward`)."""

import json
import random
from pathlib import Path


def long_row_reward(response: str, answer: str) -> float:
    return float(len(response) % 2)


def write_long_prompts(path: Path, rows: int = 8, terms: int = 750, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            xs = [rng.randint(0, 4) for _ in range(terms)]
            f.write(json.dumps({"prompt": "+".join(map(str, xs)) + "=", "answer": str(sum(xs))}) + "\n")
    return path


def long_row_overrides(data: Path, steps: int) -> list[str]:
    return [
        "data.task=files",
        f"data.train_files=[{data}]",
        "data.val_files=[]",
        "data.reward_fn=tests.e2e.long_rows:long_row_reward",
        "data.max_prompt_length=1500",
        "rollout.max_model_len=1504",
        "rollout.max_new_tokens=4",
        "model.tiny.max_positions=1504",  # the rows' positions (the default 256 would be refused)
        "trainer.prompts_per_step=4",
        "rollout.n=4",
        "roles.actor.micro_batch_size=8",
        "roles.reference.micro_batch_size=8",
        "roles.actor.max_tokens_per_micro_batch=auto",
        "roles.reference.max_tokens_per_micro_batch=auto",
        "precision.actor_dtype=fp32",
        "precision.reference_dtype=fp32",
        "precision.rollout_dtype=fp32",
        f"trainer.steps={steps}",
        "trainer.val_before_train=false",
        "logging.memory_every=1",
        "logging.wandb.mode=disabled",
    ]
