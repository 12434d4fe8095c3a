"""Rule rewards and their registry, shared by the data tasks and the reward role.

A reward function takes `(response_text, answer)` and returns a float. Users add their own by
dotted path (`my_pkg.rewards:score` or `my_pkg.rewards.score`) in `data.reward_fn`.
"""

from __future__ import annotations

import importlib
import logging
import re
from typing import Callable, Sequence

import torch

from verl_ds import algos
from verl_ds.errors import ConfigError, callable_name, real_number, where

RewardFn = Callable[[str, str], float]
log = logging.getLogger(__name__)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> str | None:
    """The answer a response commits to: what follows `####` if present, else the whole text."""
    if "####" in text:
        text = text.split("####")[-1]
    text = text.strip()
    return text or None


def _as_number(text: str | None) -> float | None:
    if text is None:
        return None
    m = _NUMBER.fullmatch(text.replace(" ", ""))
    return float(m.group(0).replace(",", "")) if m else None


def arithmetic_reward(response: str, answer: str) -> float:
    """1.0 when the response is exactly the answer's integer (optionally after `####`), else 0."""
    got = extract_answer(response)
    return 1.0 if got is not None and got == str(answer).strip() else 0.0


def gsm8k_reward(response: str, answer: str) -> float:
    """GSM8K format: the number after the last `#### ` must equal the reference's final number."""
    if "####" not in response:
        return 0.0
    want = _as_number(extract_answer(str(answer)))
    got = _as_number(extract_answer(response))
    return 1.0 if want is not None and got is not None and abs(got - want) < 1e-6 else 0.0


def last_number_reward(response: str, answer: str) -> float:
    """Lenient, for chatty instruct models: the last number in the response equals the answer."""
    nums = _NUMBER.findall(response)
    want = _as_number(str(answer).strip())
    return 1.0 if nums and want is not None and _as_number(nums[-1]) == want else 0.0


def math_verify_reward(response: str, answer: str) -> float:
    """Final answer (`\\boxed{}`, `####`, "answer is") equal to the reference as math; see `math_reward`."""
    from verl_ds.data.math_reward import math_verify_reward as fn  # sympy + antlr: imported on first use

    return fn(response, answer)


REWARD_FNS: dict[str, RewardFn] = {
    "arithmetic": arithmetic_reward,
    "gsm8k": gsm8k_reward,
    "last_number": last_number_reward,
    "math_verify": math_verify_reward,
}


def reasoning_gym_reward(response: str, answer: str) -> float:
    from verl_ds.data.reasoning_gym import reasoning_gym_reward as fn  # the package imports on first use

    return fn(response, answer)


REWARD_FNS["reasoning_gym"] = reasoning_gym_reward


def task_reward_fn(data_cfg) -> RewardFn:
    """`data.reward_fn`, with reasoning-gym's `reward_threshold` applied when set."""
    threshold = data_cfg.reasoning_gym.reward_threshold
    if data_cfg.reward_fn == "reasoning_gym" and threshold is not None:
        from verl_ds.data.reasoning_gym import reasoning_gym_reward as fn

        return lambda response, answer: fn(response, answer, threshold)
    return get_reward_fn(data_cfg.reward_fn)


def get_reward_fn(name: str, key: str = "data.reward_fn") -> RewardFn:
    """A registered name, or a dotted path `module:function` / `module.function`."""
    if name in REWARD_FNS:
        return REWARD_FNS[name]
    if name == "none":  # multi-turn: the environment's reward alone
        return lambda response, answer: 0.0
    mod, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not sep or not mod:
        raise ConfigError(
            key,
            f"unknown reward function '{name}' (registered: {', '.join(REWARD_FNS)}; "
            "or give a dotted path module:function)",
        )
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(key, f"cannot import reward function '{name}': {e}") from None
    if not callable(fn):
        raise ConfigError(key, f"'{name}' is not callable")
    return fn


def call_reward(fn: RewardFn, response: str, answer, key: str = "data.reward_fn") -> float:
    """`fn(response, answer)` held to its contract, a real number (a bool or a one-element tensor
    counts; NaN does not): a function that raises or returns anything else is one line naming the
    function, what it returned or raised, and where (its file:line), before the step trains on it.
    The traceback goes to the debug log (`logging.level: DEBUG`)."""
    name = callable_name(fn)
    try:
        value = fn(response, answer)
    except Exception as e:
        log.debug("reward function %s raised", name, exc_info=True)
        raise ConfigError(key, f"{name} raised {type(e).__name__}: {e} (at {where(e)}) for a response") from None
    number = real_number(value)
    if number is None:
        code = getattr(fn, "__code__", None)
        defined = f" ({code.co_filename}:{code.co_firstlineno})" if code else ""
        raise ConfigError(
            key,
            f"{name}{defined} returned {value!r} ({type(value).__name__}): a reward function returns a finite "
            "number for every response (0.0 for a wrong one)",
        )
    return number


def normalize_reward(
    scores: torch.Tensor | Sequence[float],
    mode: str = "batch",
    clip: float | None = None,
    stats: algos.RunningMeanStd | None = None,
) -> torch.Tensor:
    """Scores normalised as `algorithm.reward_normalization` does in the loop (the trainer calls this
    function on every rank's scores together), for a custom reward whose scale is unknown, in a
    user's own pipeline too. `mode`: "batch": (r - mean) / std over these scores; "running": over
    `stats` (an `algos.RunningMeanStd`, updated with these scores first); "none": as given. Then
    clipped to [-clip, clip] when `clip` (`algorithm.reward_clip`) is set. `[batch]` -> `[batch]` float."""
    t = scores if torch.is_tensor(scores) else torch.tensor(scores, dtype=torch.float32)
    if mode == "none":
        return t.clamp(-clip, clip) if clip else t
    return algos.normalize_rewards(t, mode=mode, clip=clip, stats=stats)
