"""Reward shaping: normalization ((r - mean) / std over the batch or running) and DAPO's overlong penalty.

Convention: scores are sequence-level rewards ``[batch]`` (any shape works: every element is a
sample). Statistics are population (biased) moments.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

REWARD_NORM_MODES = ("batch", "running")


class RunningMeanStd:
    """Running mean and population variance of a stream of scalars (Chan et al. parallel update).

    State is plain python floats (``mean``, ``var``, ``count``), checkpointed via
    ``state_dict()`` / ``load_state_dict()``. Before the first update mean = 0, var = 1 (std = 1).
    """

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, x: torch.Tensor) -> None:
        """Merge the moments of all elements of ``x`` (any shape); a no-op for an empty tensor."""
        x = x.detach().double().reshape(-1)
        n = x.numel()
        if n == 0:
            return
        batch_mean = x.mean().item()
        batch_var = x.var(unbiased=False).item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), float(state["count"])


def normalize_rewards(
    scores: torch.Tensor,
    mode: str = "batch",
    clip: Optional[float] = None,
    stats: Optional[RunningMeanStd] = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Normalize rewards: (r - mean) / (std + eps), then clamp to [-clip, clip] when ``clip`` is set.

    Shapes: ``scores`` ``[batch]`` -> ``[batch]`` (floating dtype of ``scores``, fp32 for integers).
      * ``mode="batch"``: mean and population std of this batch (a single sample maps to 0).
      * ``mode="running"``: ``stats`` (a :class:`RunningMeanStd`, required) is first updated with
        this batch, then its mean / std are used.
    """
    x = scores if scores.is_floating_point() else scores.float()
    if mode == "batch":
        mean = x.mean()
        std = x.std(unbiased=False) if x.numel() > 1 else x.new_zeros(())
    elif mode == "running":
        if stats is None:
            raise ValueError("normalize_rewards(mode='running') needs stats=RunningMeanStd()")
        stats.update(x)
        mean, std = stats.mean, stats.std
    else:
        raise ValueError(f"unknown reward normalization mode {mode!r}; known: {REWARD_NORM_MODES}")
    out = (x - mean) / (std + eps)
    return out if clip is None else out.clamp(-clip, clip)


def overlong_penalty(
    response_lengths: torch.Tensor, max_new_tokens: int, buffer_len: int, penalty: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025; verl ``DAPORewardManager`` ``overlong_buffer``).

    Shapes: ``response_lengths`` ``[batch]`` (token counts) -> ``[batch]`` float32, added to the scores.
    With expected = max_new_tokens - buffer_len: min(-(length - expected) / buffer_len * penalty, 0), i.e.
    0 up to ``expected``, then linear down to -penalty at length == max_new_tokens (and on beyond it,
    as verl). ``buffer_len`` 0 disables it (zeros); it must lie in [0, max_new_tokens].
    """
    if not 0 <= buffer_len <= max_new_tokens:
        raise ValueError(f"buffer_len must be in [0, max_new_tokens={max_new_tokens}], got {buffer_len}")
    lengths = response_lengths.float()
    if buffer_len == 0:
        return torch.zeros_like(lengths)
    exceed = lengths - (max_new_tokens - buffer_len)
    return (-exceed / buffer_len * penalty).clamp(max=0.0)
