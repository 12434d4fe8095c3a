"""Procedural reasoning tasks from the `reasoning-gym` package (offline), scored by its own
`score_answer`. An example's `answer` carries the whole generator entry (JSON), so the reward
function can call the right scorer; `reward_threshold` turns partial credit into 0/1."""

from __future__ import annotations

import json
import re

from verl_ds.errors import ConfigError

INSTRUCTION = "\nGive only the final answer on the last line, as: Answer: <answer>"
_ANSWER = re.compile(r"answer\s*[:：]\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _rg():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(
            "data.task",
            "task 'reasoning_gym' needs the reasoning-gym package (pip install reasoning-gym, or bash launch/demo.sh)",
        ) from None
    return reasoning_gym


def reasoning_gym_examples(name: str, size: int, seed: int, config: dict) -> list[dict]:
    """`size` generated problems as {prompt, answer (the entry as JSON)}."""
    try:
        ds = _rg().create_dataset(name, size=size, seed=seed, **(config or {}))
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError("data.reasoning_gym", f"cannot create '{name}' with {config or {}}: {e}") from None
    return [{"prompt": e["question"] + INSTRUCTION, "answer": json.dumps(e, default=str)} for e in ds]


def reasoning_gym_split(g) -> tuple[list[dict], list[dict]]:
    """`data.reasoning_gym`'s (train, validation) examples: the validation seed's problems that the
    training set does not hold."""
    train = reasoning_gym_examples(g.name, g.size, g.seed, g.config)
    seen = {e["prompt"] for e in train}
    val = [e for e in reasoning_gym_examples(g.name, g.val_size, g.val_seed, g.config) if e["prompt"] not in seen]
    return train, val


def final_answer(response: str, numeric: bool = False) -> str:
    """What follows the last `Answer:`, else the last non-empty line; for a numeric task the last
    number in that text (a "flexible extract": `Answer: 3 + 4 = 7` and `3 + 4 = 7` both give 7)."""
    hits = _ANSWER.findall(response)
    if numeric:
        nums = _NUMBER.findall(hits[-1] if hits else response)
        return nums[-1] if nums else ""
    if hits:
        return hits[-1].strip()
    lines = [ln.strip() for ln in response.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _is_number(text) -> bool:
    return bool(_NUMBER.fullmatch(str(text).strip()))


def reasoning_gym_reward(response: str, answer: str, threshold: float | None = None) -> float:
    """The generator's own score of the response's final answer (0 on any failure)."""
    try:
        entry = json.loads(answer)
        score = float(
            _rg().get_score_answer_fn(entry["metadata"]["source_dataset"])(
                final_answer(response, numeric=_is_number(entry["answer"])), entry
            )
        )
    except Exception:  # a malformed response must never stop training
        return 0.0
    return float(score >= threshold) if threshold is not None else score
