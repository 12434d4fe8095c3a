"""Run by test_two_ranks.py under `deepspeed --num_gpus 2` (CPU, gloo): ZeRO-3 gather and step sync;
at ZeRO-0, our bucketed gradient all-reduce against DeepSpeed's own."""

import atexit
import hashlib
import os
import sys

import torch
import torch.distributed as dist

from tests.roles.helpers import Cfg, ds_config, make_batch, make_group_batch, update
from verl_ds.dist import BucketAllReduce, all_reduce_max, all_reduce_min, all_reduce_sum, init_distributed, sum_
from verl_ds.roles import Actor, iter_full_params, load_causal_lm
from verl_ds.roles.ds_internals import backward_allreduce, set_backward_allreduce


def digest(engine) -> str:
    h = hashlib.sha256()
    for name, t in iter_full_params(engine):  # collective under ZeRO-3: every rank iterates
        h.update(name.encode())
        h.update(t.float().numpy().tobytes())
    return h.hexdigest()


def main(model_dir: str, stage: int) -> None:
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    sums_are_sums(rank, world)
    ds = ds_config("actor", stage, "fp32", micro=2, total=4)
    ds["train_batch_size"] = 2 * world  # 2 per rank, no accumulation
    ds["gradient_accumulation_steps"] = 1
    actor = Actor(load_causal_lm(model_dir), ds, Cfg())
    before = digest(actor.engine)
    everyone = [None] * world
    dist.all_gather_object(everyone, before)
    assert len(set(everyone)) == 1, f"ZeRO-{stage} gather differs across ranks: {everyone}"
    batch = make_batch(actor.module.config.vocab_size, b=2, seed=rank)  # different data per rank
    lp = actor.logprobs(batch)
    batch = batch.replace(old_logprobs=lp, advantages=torch.randn_like(lp))
    tokens = torch.tensor([float(batch.loss_mask.sum())])
    dist.all_reduce(tokens)
    update(actor, batch, global_tokens=tokens.item(), global_seqs=2.0 * world)
    after = digest(actor.engine)
    dist.all_gather_object(everyone, after)
    assert len(set(everyone)) == 1, f"ranks diverged after a step at ZeRO-{stage}"
    assert after != before, "the step changed nothing"
    scoring_passes_match_across_ranks(actor, rank)
    shared_prompts_step_in_sync(actor, rank, world)
    if stage == 0:
        same_update_as_deepspeed_reduction(model_dir, rank)
    if rank == 0:
        print(f"TWO_RANK_OK stage={stage}", flush=True)


def sums_are_sums(rank: int, world: int) -> None:
    """sum_ is a SUM over ranks through DeepSpeed's shm kernel (fp32, bf16, fp16; 12 MB, several of
    its chunks) and through the process group where the kernel would silently do nothing (float64);
    so are min/max/sum of a few numbers."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(3 << 20, generator=g) for _ in range(world)]  # 12 MB: the kernel's chunks
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        t = parts[rank].to(dtype, copy=True)
        sum_(t)
        want = sum(p.to(dtype).float() for p in parts)
        torch.testing.assert_close(t.float(), want, rtol=0.02 if t.element_size() == 2 else 1e-6, atol=0.02)
    assert all_reduce_sum([1.0 + rank, 10.0]) == [sum(1.0 + r for r in range(world)), 10.0 * world]
    assert all_reduce_min(5.0 - rank) == 5.0 - (world - 1) and all_reduce_max(float(rank)) == world - 1


def scoring_passes_match_across_ranks(actor, rank: int) -> None:
    """Token budget: rank 1's rows are twice as long, so it packs 4 micro-batches where rank 0 packs 2;
    both run 4 forwards (under ZeRO-3 each one gathers the weights with the other rank), and the
    logprobs equal the row-count path's."""
    batch = make_batch(actor.module.config.vocab_size, b=4, p=5 * (rank + 1), r=3 * (rank + 1), seed=20 + rank)
    actor.max_tokens = 0
    want = actor.logprobs(batch)  # 2-row micro-batches: 2 forwards on each rank
    actor.max_tokens = 16
    calls = []
    hook = actor.module.register_forward_hook(lambda *_: calls.append(1))
    got = actor.logprobs(batch)
    hook.remove()
    actor.max_tokens = 0
    real = batch.loss_mask > 0  # masked positions: 0 where padding was removed
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)
    counts = [None, None]
    dist.all_gather_object(counts, len(calls))
    assert counts == [4, 4], counts


def shared_prompts_step_in_sync(actor, rank: int, world: int) -> None:
    """Shared-prefix passes where the ranks' prompts differ in number and length: the logprobs equal
    the full-sequence path's, and a step keeps the ranks' weights identical (under ZeRO-3 one rank's
    shared pass gathers the weights with the other's, forward and backward)."""
    shapes = [((2, 5), (1, 3, 2)), ((6, 3, 4), (2, 2))][rank]
    batch = make_group_batch(actor.module.config.vocab_size, *shapes, seed=30 + rank)
    real = batch.loss_mask > 0
    want = actor.logprobs(batch)
    actor.share_prefixes, actor.share_min_tokens = True, 0
    got = actor.logprobs(batch)
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)
    batch = batch.replace(old_logprobs=got, advantages=torch.randn_like(got))
    tokens = torch.tensor([float(batch.loss_mask.sum()), float(len(got))])
    dist.all_reduce(tokens)
    before = digest(actor.engine)
    update(actor, batch, global_tokens=tokens[0].item(), global_seqs=tokens[1].item())
    actor.share_prefixes = False
    everyone = [None] * world
    dist.all_gather_object(everyone, digest(actor.engine))
    assert len(set(everyone)) == 1 and everyone[0] != before, "shared prompt passes: ranks diverged"


def same_update_as_deepspeed_reduction(model_dir: str, rank: int) -> None:
    """Two accumulated micro-batches per rank: BucketAllReduce (a small bucket, so both the bucketed
    and the in-place path run) gives bitwise the weights DeepSpeed's own all-reduce gives."""
    ds = ds_config("actor", 0, "fp32", micro=1, total=4)
    ds["train_batch_size"], ds["gradient_accumulation_steps"] = 4, 2  # 2 ranks x 1 row x 2 micro-steps
    ours, theirs = Actor(load_causal_lm(model_dir), ds, Cfg()), Actor(load_causal_lm(model_dir), ds, Cfg())
    assert ours._reducer is not None and not backward_allreduce(ours.engine)
    ours._reducer = BucketAllReduce(bucket_bytes=32 << 10)
    theirs._reducer = None
    set_backward_allreduce(theirs.engine, True)
    before = digest(ours.engine)
    batch = make_batch(ours.module.config.vocab_size, b=2, seed=10 + rank)
    lp = ours.logprobs(batch)
    adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(rank))
    batch = batch.replace(old_logprobs=lp, advantages=adv)
    tokens = torch.tensor([float(batch.loss_mask.sum())])
    dist.all_reduce(tokens)
    for actor in (ours, theirs):
        update(actor, batch, global_tokens=tokens.item(), global_seqs=4.0)
    a, b = dict(iter_full_params(ours.engine)), dict(iter_full_params(theirs.engine))
    assert digest(ours.engine) != before, "the step changed nothing"
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(args[0], int(args[1]))
    # as the CLI ends a rank: exit handlers, then no interpreter teardown, where a rank once aborted
    # ("terminate called without an active exception", exit -6) after both had passed
    dist.barrier()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    os._exit(0)
