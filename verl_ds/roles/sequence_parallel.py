"""Sequence parallelism for the policy models' passes, through DeepSpeed's own ALST code (Ulysses SP for
Hugging Face models, `deepspeed.runtime.sequence_parallel.ulysses_sp`): each row's tokens are split along
the sequence over the ranks of a sequence-parallel group, and every attention layer all-to-alls its
sequence shards into head shards and back (`UlyssesSPAttentionHF`, registered in place of the model's
attention implementation). This module owns the SP group and the sharding; the roles stay unaware of it.

What holds the result exact:
- a row runs alone, its real tokens from position 0 and padding only at its end (to a multiple of the SP
  size): DeepSpeed's wrapper drops the attention mask, and causal attention without one is the masked
  attention of such a row (a trailing pad attends only to what comes before it; nothing real attends to
  it). Rows packed into one sequence would attend across each other without varlen flash-attention;
- each shard predicts the next token at every position, its last position's label being the next shard's
  first token (a shard-local `logits[:, :-1]` would drop one token at every boundary);
- position ids are the row's own (DeepSpeed all-gathers them for the causal mask).

Status (issue 57): scoring passes (logprobs), proven against the unsplit pass on 2 CPU ranks
(`tests/roles/test_sequence_parallel.py`); not yet the update's backward, nor wired into the trainer or
the run config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl_ds import algos
from verl_ds.roles.batch import TrainBatch


@dataclass(frozen=True)
class SequenceParallel:
    """This process's SP group: `size` ranks, this one `rank` among them."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def register(cls, model, size: int, attn_implementation: str = "sdpa") -> SequenceParallel:
        """DeepSpeed's registration for `model` (its attention implementation must be `attn_implementation`):
        the SP groups of the world, and the wrapper in place of that attention for every model of this
        process. Once per process: DeepSpeed's SP group is process-global, so every role shares it.
        -> this rank's group (its `mpu` is DeepSpeed's `parallel_state_sp`)."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model, attn_implementation, size, micro_batch_size=1, seq_length_is_variable=True
        )
        group = mpu.get_sequence_parallel_group()
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def shard(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One row's real tokens `[n]` -> this rank's (ids `[1, c]`, position ids `[1, c]`, labels `[c]`):
        the row padded at its end to `c * size` tokens, positions counted from 0, each position's label the
        token after it (the next shard's first at this shard's end; a pad past the row's last token)."""
        n = len(ids)
        c = -(-n // self.size)
        full = torch.nn.functional.pad(ids, (0, c * self.size + 1 - n))  # one more: the last position's label
        lo, hi = self.rank * c, (self.rank + 1) * c
        pos = torch.arange(lo, hi, device=ids.device)[None]
        return full[None, lo:hi], pos, full[lo + 1 : hi + 1]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every shard's `[c]` values, in sequence order: `[c * size]` on every rank of the group."""
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts)

    def row_logprobs(self, model, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """`[n - 1]`: the log-probability of each token of the row `ids` after the one before it, the row
        split over the group. Collective: every rank of the group passes the same row."""
        local_ids, pos, labels = self.shard(ids)
        logits = model(input_ids=local_ids, position_ids=pos, use_cache=False).logits
        if temperature != 1.0:
            logits = logits / temperature
        lp = algos.logprobs_from_logits(logits, labels[None], chunk_size=1024)[0]
        return self.gather(lp)[: len(ids) - 1]

    @torch.no_grad()
    def logprobs(self, model, batch: TrainBatch, temperature: float = 1.0) -> torch.Tensor:
        """`[B, R]` fp32 log-probabilities of the response tokens, as `PolicyRole.logprobs` gives them
        (0 where the response is padding), each row split over the group. Collective: every rank of the
        group passes the same batch."""
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        width = batch.response_width
        prompt_cols = batch.attention_mask.shape[1] - width
        for i in range(len(batch)):
            real = batch.attention_mask[i].bool()
            ids = batch.input_ids[i][real]
            p = int(real[:prompt_cols].sum())  # the row's real prompt tokens
            r = int(real[prompt_cols:].sum())  # and response tokens (right-padded)
            lp = self.row_logprobs(model, ids, temperature).float().cpu()
            out[i, :r] = lp[p - 1 : p - 1 + r]  # response token j sits at p + j, predicted at p + j - 1
        return out
