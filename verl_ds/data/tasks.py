"""Prompt sources: the built-in offline `arithmetic` task and local jsonl/parquet files."""
from __future__ import annotations

import random
from pathlib import Path

from verl_ds.errors import ConfigError


def arithmetic_examples(size: int, seed: int, min_value: int = 0, max_value: int = 4,
                        num_operands: int = 2, ops: str = "+") -> list[dict]:
    """Seeded `a+b=` problems. Difficulty knobs: operand range, operand count, operators."""
    bad = set(ops) - set("+-*")
    if bad or not ops:
        raise ConfigError("data.arithmetic.ops", f"use a subset of '+-*', got '{ops}'")
    if num_operands < 2 or max_value < min_value:
        raise ConfigError("data.arithmetic", "need num_operands >= 2 and min_value <= max_value")
    rng = random.Random(seed)
    out = []
    for _ in range(size):
        nums = [rng.randint(min_value, max_value) for _ in range(num_operands)]
        expr = str(nums[0])
        for n in nums[1:]:
            expr += rng.choice(ops) + str(n)
        out.append({"prompt": expr + "=", "answer": str(eval(expr))})  # digits and + - * only
    return out


def file_examples(files: list[str], prompt_key: str, answer_key: str) -> list[dict]:
    """Rows from local jsonl/parquet files through `datasets`, as {prompt, answer}."""
    from datasets import load_dataset

    for f in files:
        if not Path(f).is_file():
            raise ConfigError("data.train_files", f"file not found: {f}")
    kinds = {Path(f).suffix for f in files}
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(kinds.pop() if len(kinds) == 1 else "")
    if kind is None:
        raise ConfigError("data.train_files", "use only .jsonl or only .parquet files")
    ds = load_dataset(kind, data_files=list(files), split="train")
    for key in (prompt_key, answer_key):
        if key not in ds.column_names:
            raise ConfigError("data.prompt_key" if key == prompt_key else "data.answer_key",
                              f"column '{key}' not in {files} (columns: {ds.column_names})")
    return [{"prompt": str(r[prompt_key]), "answer": str(r[answer_key])} for r in ds]
