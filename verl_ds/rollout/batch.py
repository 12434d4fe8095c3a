"""`RolloutBatch`: what a rollout engine hands the trainer, as padded tensors.

Prompts are left-padded (so every response starts at column P), responses right-padded. The eos
token, when generated, is part of the response and of its mask: the policy must learn to emit it.

A multi-turn episode's "response" is everything after its first prompt: model turns interleaved with
environment tokens (tool results, user messages). `response_mask` marks the real tokens (what the
model attends to), `loss_mask` the model's own tokens (what every loss, KL, entropy and metric
counts); in a single-turn batch the two are equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # [B, P] long, left-padded with pad_id
    response_ids: torch.Tensor  # [B, R] long, right-padded with pad_id
    input_ids: torch.Tensor  # [B, P+R] prompt ++ response
    attention_mask: torch.Tensor  # [B, P+R] long 0/1
    response_mask: torch.Tensor  # [B, R] float 0/1
    rollout_logprobs: torch.Tensor  # [B, R] float32, processed (after temperature); 0 where masked
    group_ids: torch.Tensor  # [B] long: index of the prompt in its generate call
    finish_reasons: list[str] = field(default_factory=list)  # "stop" | "length"
    pad_id: int = 0
    loss_mask: torch.Tensor | None = None  # [B, R] float 0/1: model tokens; None: = response_mask

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = self.response_mask

    @classmethod
    def from_lists(
        cls,
        prompts: list[list[int]],
        responses: list[list[int]],
        logprobs: list[list[float]],
        finish_reasons: list[str],
        group_ids: list[int],
        pad_id: int,
        loss_masks: list[list[float]] | None = None,
    ) -> RolloutBatch:
        """Pad ragged per-sample lists into tensors (one row per sample). `loss_masks`: per response
        token 1 (model) or 0 (environment); None: every response token is the model's."""
        b = len(prompts)
        assert len(responses) == len(logprobs) == len(finish_reasons) == len(group_ids) == b
        for i, (rs, lp) in enumerate(zip(responses, logprobs)):
            assert len(rs) == len(lp), f"sample {i}: {len(rs)} tokens but {len(lp)} logprobs"
        p = max((len(x) for x in prompts), default=0)
        r = max((len(x) for x in responses), default=0)
        # padded in Python, one tensor per field: a row-by-row tensor fill costs a small copy per sample
        prompt_ids = torch.tensor([[pad_id] * (p - len(x)) + list(x) for x in prompts], dtype=torch.long)
        prompt_mask = torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts], dtype=torch.long)
        response_ids = torch.tensor([list(x) + [pad_id] * (r - len(x)) for x in responses], dtype=torch.long)
        response_mask = torch.tensor([[1.0] * len(x) + [0.0] * (r - len(x)) for x in responses], dtype=torch.float32)
        lp = torch.tensor([list(x) + [0.0] * (r - len(x)) for x in logprobs], dtype=torch.float32)
        prompt_ids, prompt_mask = prompt_ids.reshape(b, p), prompt_mask.reshape(b, p)
        response_ids, response_mask, lp = response_ids.reshape(b, r), response_mask.reshape(b, r), lp.reshape(b, r)
        loss_mask = None
        if loss_masks is not None:
            assert all(len(m) == len(x) for m, x in zip(loss_masks, responses)), "a loss mask per response token"
            loss_mask = torch.tensor([list(m) + [0.0] * (r - len(m)) for m in loss_masks], dtype=torch.float32).reshape(
                b, r
            )
        return cls(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            input_ids=torch.cat([prompt_ids, response_ids], dim=1),
            attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
            response_mask=response_mask,
            rollout_logprobs=lp,
            group_ids=torch.as_tensor(list(group_ids), dtype=torch.long),
            finish_reasons=list(finish_reasons),
            pad_id=pad_id,
            loss_mask=loss_mask,
        )

    @property
    def multi_turn(self) -> bool:
        """Whether some response holds environment tokens (loss mask != response mask)."""
        return self.loss_mask is not self.response_mask and not torch.equal(self.loss_mask, self.response_mask)

    def to_lists(self) -> dict[str, list]:
        """The unpadded per-sample lists `from_lists` takes (inverse of `from_lists`)."""
        p = self.prompt_ids.shape[1]
        plen = self.attention_mask[:, :p].sum(1).tolist()
        rlen = self.response_mask.sum(1).long().tolist()
        out = dict(
            prompts=[self.prompt_ids[i, p - n :].tolist() for i, n in enumerate(plen)],
            responses=[self.response_ids[i, :n].tolist() for i, n in enumerate(rlen)],
            logprobs=[self.rollout_logprobs[i, :n].tolist() for i, n in enumerate(rlen)],
            finish_reasons=list(self.finish_reasons),
            group_ids=self.group_ids.tolist(),
        )
        if self.multi_turn:
            out["loss_masks"] = [self.loss_mask[i, :n].tolist() for i, n in enumerate(rlen)]
        return out

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, indices) -> RolloutBatch:
        """Rows `indices` (a list or long tensor), keeping the current padding."""
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        return RolloutBatch(
            prompt_ids=self.prompt_ids[idx],
            response_ids=self.response_ids[idx],
            input_ids=self.input_ids[idx],
            attention_mask=self.attention_mask[idx],
            response_mask=self.response_mask[idx],
            rollout_logprobs=self.rollout_logprobs[idx],
            group_ids=self.group_ids[idx],
            finish_reasons=[self.finish_reasons[i] for i in idx.tolist()],
            pad_id=self.pad_id,
            loss_mask=self.loss_mask[idx] if self.multi_turn else None,
        )

    def chunk(self, k: int) -> list[RolloutBatch]:
        """Split into `k` contiguous parts (sizes differ by at most 1; parts may be empty)."""
        sizes = [len(self) // k + (1 if i < len(self) % k else 0) for i in range(k)]
        out, start = [], 0
        for s in sizes:
            out.append(self.select(list(range(start, start + s))))
            start += s
        return out

    @staticmethod
    def cat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Concatenate rows, re-padding to the widest prompt and response. group_ids are kept."""
        assert batches, "cat of no batches"
        parts = [b.to_lists() for b in batches]
        if any("loss_masks" in p for p in parts):  # single-turn parts: every response token is the model's
            for p in parts:
                p.setdefault("loss_masks", [[1.0] * len(r) for r in p["responses"]])
        merged = {k: sum((p[k] for p in parts), []) for k in parts[0]}
        return RolloutBatch.from_lists(**merged, pad_id=batches[0].pad_id)
