"""Prompt sources: the built-in offline `arithmetic` task, local jsonl/parquet files and reasoning-gym's
generators, as (train, validation) examples (`load_examples`)."""

from __future__ import annotations

import random
from pathlib import Path

from verl_ds.errors import ConfigError, shown


def load_examples(data_cfg) -> tuple[list[dict], list[dict]]:
    """(train, validation) examples. Files: `train_files` / `val_files`. The built-in task holds out
    `val_fraction` of its distinct prompts (seeded): they never appear in training."""
    if data_cfg.task == "arithmetic":
        a = data_cfg.arithmetic
        rows = arithmetic_examples(a.size, data_cfg.seed, a.min_value, a.max_value, a.num_operands, a.ops)
        return held_out_split(rows, data_cfg.val_fraction, data_cfg.seed)
    if data_cfg.task == "files":
        train = file_examples(data_cfg.train_files, data_cfg.prompt_key, data_cfg.answer_key)
        val = file_examples(data_cfg.val_files, data_cfg.prompt_key, data_cfg.answer_key) if data_cfg.val_files else []
        return train, val
    from verl_ds.data.reasoning_gym import reasoning_gym_split  # task: reasoning_gym (an optional package)

    return reasoning_gym_split(data_cfg.reasoning_gym)


def held_out_split(rows: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Hold out a seeded `fraction` of the distinct prompts: (train rows without them, one row each)."""
    distinct = sorted({r["prompt"]: r for r in rows}.items())
    if fraction <= 0 or len(distinct) < 2:
        return rows, []
    random.Random(seed).shuffle(distinct)
    held = dict(distinct[: max(1, round(fraction * len(distinct)))])
    return [r for r in rows if r["prompt"] not in held], list(held.values())


def arithmetic_examples(
    size: int, seed: int, min_value: int = 0, max_value: int = 4, num_operands: int = 2, ops: str = "+"
) -> list[dict]:
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
    """Rows from local jsonl (read here, so a bad line is named) or parquet files, as {prompt, answer}
    plus the row's other keys (an environment or agent reads them from its example, e.g. a game seed)."""
    kinds = {Path(f).suffix for f in files}
    kind = kinds.pop() if len(kinds) == 1 else ""
    if kind not in (".jsonl", ".parquet"):
        raise ConfigError(", ".join(files), "use only .jsonl or only .parquet files")
    rows = [r for f in files for r in (_jsonl_rows(f) if kind == ".jsonl" else _parquet_rows(f))]
    out = []
    for where, r in rows:
        for key, name in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
            if key not in r:
                raise ConfigError(name, f"'{key}' missing in {where} (keys: {sorted(r)})")
        if not isinstance(r[prompt_key], str):  # a number or a message list would train as its repr
            raise ConfigError(where, f"'{prompt_key}' must be a string, got {shown(r[prompt_key])}")
        rest = {k: v for k, v in r.items() if k not in (prompt_key, answer_key)}
        out.append({**rest, "prompt": r[prompt_key], "answer": str(r[answer_key])})  # answers: 42 reads as "42"
    return out


def check_data_files(data_cfg) -> list[ConfigError]:
    """What `train` would refuse of the data files that are here, checked cheaply for `config render`:
    a file with no rows, a .parquet without parquet's magic bytes, a first row that does not parse or
    lacks the prompt or answer key."""
    if data_cfg.task != "files":
        return []
    errors = []
    for key in ("train_files", "val_files"):
        for i, f in enumerate(getattr(data_cfg, key)):
            p = Path(f)
            if not p.is_file():
                continue  # validate_paths says so
            try:
                if p.suffix == ".parquet":
                    with open(p, "rb") as fh:
                        head = fh.read(4)
                    if head != b"PAR1":
                        errors.append(ConfigError(f"data.{key}[{i}]", f"{f} is not a parquet file (no PAR1 header)"))
                    continue
                first = next(iter(_jsonl_rows(f)), None)
                if first is None:
                    errors.append(ConfigError(f"data.{key}[{i}]", f"{f} holds no rows"))
                    continue
                where, row = first
                for k, name in ((data_cfg.prompt_key, "data.prompt_key"), (data_cfg.answer_key, "data.answer_key")):
                    if k not in row:
                        errors.append(ConfigError(name, f"'{k}' missing in {where} (keys: {sorted(row)})"))
            except ConfigError as e:
                errors.append(e)
    return errors


def _jsonl_rows(path: str):
    import json

    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"{path}:{n}", f"not UTF-8 text (byte {e.start} of the line); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}", f"malformed JSON line ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{n}", "each line must be a JSON object")
            yield f"{path}:{n}", row


def _parquet_rows(path: str):
    from datasets import load_dataset

    try:
        ds = load_dataset("parquet", data_files=[path], split="train")
    except Exception as e:  # pyarrow's many error types for a damaged or foreign file
        raise ConfigError(
            path, f"not a readable parquet file ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None
    for n, r in enumerate(ds):
        yield f"{path} row {n}", r
