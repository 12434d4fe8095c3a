"""`TrainBatch`: the rows a role scores or trains on, typed (torchtune's `GRPOTrajectory`, OpenRLHF's
`Experience`). Shapes: `B` rows of `T = P + R` columns, a left-padded prompt then a right-padded
response in the last `R` columns. Per-token tensors are `[B, R]`, fp32 unless stated.

A scoring pass (`logprobs`, `values`, `score`) reads the three input fields; the trainer adds what
the step computed, and each loss says which fields it needs (`require`): a missing one is an error,
never a silently different loss.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class TrainBatch:
    input_ids: Tensor  # [B, T] long
    attention_mask: Tensor  # [B, T] every real token (prompt, model and environment tokens)
    # [B, R] the tokens every loss, KL, entropy and advantage counts: the model's own (multi-turn
    # environment tokens, and truncated rows under `algorithm.mask_truncated`, are 0)
    loss_mask: Tensor
    advantages: Tensor | None = None  # [B, R]
    returns: Tensor | None = None  # [B, R] the critic's targets
    old_logprobs: Tensor | None = None  # [B, R] the policy before this update (PPO's ratio denominator)
    ref_logprobs: Tensor | None = None  # [B, R] the reference policy (a KL loss)
    teacher_logprobs: Tensor | None = None  # [B, R] the distillation teacher (a distillation loss)
    old_values: Tensor | None = None  # [B, R] the critic before this update (value clipping)
    rollout_logprobs: Tensor | None = None  # [B, R] the rollout engine's own (truncated IS weights)
    # True: no `old_logprobs` exist yet because this pass's own forward is the old policy (one
    # mini-batch in the first epoch: ratio 1, exact); the trainer says so, the loss does not guess
    on_policy: bool = False
    rows: Tensor | None = None  # [B] long: a micro-batch's positions in the batch it came from
    pad_row: bool = False  # a stand-in micro-batch (one row, fully masked): a zero loss, a real backward

    TENSORS = (
        "input_ids",
        "attention_mask",
        "loss_mask",
        "advantages",
        "returns",
        "old_logprobs",
        "ref_logprobs",
        "teacher_logprobs",
        "old_values",
        "rollout_logprobs",
    )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_width(self) -> int:
        return self.loss_mask.shape[1]

    def replace(self, **fields) -> TrainBatch:
        return dataclasses.replace(self, **fields)

    def _map(self, fn) -> dict:
        return {k: (None if (v := getattr(self, k)) is None else fn(v)) for k in self.TENSORS}

    def to(self, device) -> TrainBatch:
        return self.replace(**self._map(lambda t: t.to(device)))

    def select(self, idx: Tensor) -> TrainBatch:
        """Rows `idx`, which they were (`rows`). No rows: the first row with its loss mask zeroed
        (`pad_row`), so a rank with less work still runs a forward and backward like the others."""
        if len(idx) == 0:
            one = self.replace(**self._map(lambda t: t[:1]))
            return one.replace(loss_mask=torch.zeros_like(one.loss_mask), pad_row=True, rows=idx)
        return self.replace(**self._map(lambda t: t[idx.to(t.device)]), rows=idx)

    def require(self, *names: str, needed_by: str) -> None:
        """Each of `names` is present, or one error naming the missing fields and who needs them."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{needed_by} needs {', '.join(missing)} in the train batch")
