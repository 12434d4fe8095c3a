"""The update phase: `ppo_epochs` over mini-batches for the actor and the critic, each mini-batch's
loss normalised by its token and sequence counts over every rank, an overflow in either role skipping
both (fp16 loss scaling)."""

from __future__ import annotations

from typing import Callable

import torch

from verl_ds import algos
from verl_ds.diagnostics.metrics import Timer
from verl_ds.dist import all_reduce_max, all_reduce_sum
from verl_ds.roles import align_overflow
from verl_ds.roles.batch import TrainBatch


def mini_batches(n: int, mini_rows: int) -> int:
    """Mini-batches per epoch, the same on every rank (forked multi-turn episodes give ranks different
    row counts): the most any rank needs for `n` rows of `mini_rows` each. Collective: no early exit."""
    return max(1, int(all_reduce_max(float(-(-n // max(mini_rows, 1))))))


def ppo_update(
    actor,
    critic,
    train: TrainBatch,
    timer: Timer,
    epochs: int,
    mini: int,
    n_minis: int,
    buffered: Callable[[torch.Tensor], torch.Tensor],
    first_check: Callable[[torch.Tensor], None] | None = None,
) -> tuple[dict, torch.Tensor | None]:
    """`epochs` over `n_minis` mini-batches of `mini` rows -> (metrics, the first epoch's fp32 logprobs
    when `train.on_policy`, else None). On-policy, the first epoch (one mini-batch, in order) computes
    the old logprobs; the later epochs read them, `buffered` (the buffer dtype), from a copy of `train`.
    `first_check(those logprobs)` runs before any optimizer step (the sync's check: it may stop the run)."""
    n = len(train)
    sums: dict[str, float] = {}
    count, first_lp = 0, None
    for _ in range(epochs):
        collect = train.on_policy  # one mini-batch: the whole batch, in order
        perm = torch.arange(n) if collect else torch.randperm(n)
        if actor.sp:  # a sequence-parallel group shares its rows, and so their order
            perm = actor.sp.same(perm)
        # mini-batches of `mini` rows; a rank with fewer rows than another splits them as evenly
        parts = perm.split(mini) if -(-n // mini) == n_minis else perm.tensor_split(n_minis)
        for rows in parts:
            mb = train.select(rows)
            tokens, seqs = _global_counts(mb.loss_mask, actor.sp.size if actor.sp else 1)
            with timer("update_actor", stage="update", role="actor"):
                acc = actor.accumulate(mb, tokens, seqs, keep=collect)
            m = acc.metrics
            if collect:
                first_lp = acc.outputs.float().cpu()
                if first_check is not None:
                    first_check(first_lp)
            if critic:
                with timer("update_critic", stage="update", role="critic"):
                    critic_m = critic.accumulate(mb, tokens, seqs).metrics
                m.update({f"critic/{k}": v for k, v in critic_m.items()})
                align_overflow(actor, critic)  # an overflow in either skips both
                with timer("update_critic", stage="update", role="critic"):
                    critic.step()
            with timer("update_actor", stage="update", role="actor"):
                actor.step()
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
        if collect:
            train = train.replace(old_logprobs=buffered(first_lp), on_policy=False)
    out = {(k if k.startswith("critic/") else f"actor/{k}"): v / count for k, v in sums.items()}
    if critic:
        out["critic/vf_explained_var"] = _explained_var(train.returns, train.old_values, train.loss_mask)
    return out, first_lp


def _global_counts(mask: torch.Tensor, replicas: int = 1) -> tuple[float, float]:
    """Response tokens and sequences in the whole mini-batch, over every rank, each row counted once
    where `replicas` ranks (a sequence-parallel group) hold it (at least 1: a mini-batch of only
    masked-out samples contributes a zero loss, not NaN)."""
    tokens, seqs = all_reduce_sum([float(mask.sum()), float(mask.shape[0])])
    return max(tokens / replicas, 1.0), seqs / replicas


def _explained_var(returns, values, mask) -> float:
    var_r = algos.masked_var(returns, mask)
    return float(1 - algos.masked_var(returns - values, mask) / (var_r + 1e-8))
