"""Run by test_sequence_parallel.py under `deepspeed --num_gpus 2` (CPU, gloo): a frozen policy role's
logprobs with each row split over 2 ranks by DeepSpeed's Ulysses SP equal the unsplit pass's."""

import atexit
import os
import sys

import torch
import torch.distributed as dist

from tests.roles.helpers import ds_config, make_group_batch
from verl_ds.dist import init_distributed, world_size
from verl_ds.roles import Reference, load_causal_lm
from verl_ds.roles.sequence_parallel import SequenceParallel


def main(model_dir: str, stage: int) -> None:
    init_distributed()
    ds = ds_config("reference", stage, "fp32", micro=4, total=4)
    ds["train_batch_size"] = 4 * world_size()
    ref = Reference(load_causal_lm(model_dir, attn_implementation="sdpa"), ds)
    vocab = ref.module.config.vocab_size
    # rows of unequal length in one batch (left-padded prompts, right-padded responses), odd lengths
    # SP 2 does not divide, and shard boundaries inside responses (a dropped boundary token shows there)
    batch = make_group_batch(vocab, prompt_lens=(2, 5, 3), resp_lens=(9, 6, 3, 8), seed=7)
    lengths = batch.attention_mask.sum(1).tolist()
    assert any(n % 2 for n in lengths) and len(set(lengths)) > 3, lengths
    plens = (batch.attention_mask[:, : -batch.response_width].sum(1)).tolist()
    assert any(-(-n // 2) > p for n, p in zip(lengths, plens)), "no shard boundary inside a response"
    want = ref.logprobs(batch)  # the role's own pass, unsplit (before SP is registered)

    sp = SequenceParallel.register(ref.module, 2)
    assert (sp.size, world_size()) == (2, 2)
    got = sp.logprobs(ref.engine, batch)
    mask = batch.attention_mask[:, -batch.response_width :].bool()
    diff = float((got - want)[mask].abs().max())
    assert diff <= 1e-5, f"SP 2 logprobs differ from SP 1 by {diff:.3g}"
    assert torch.all(got[~mask] == 0)
    print(f"SP_OK stage={stage} max_abs_diff={diff:.3g} tokens={int(mask.sum())}", flush=True)


if __name__ == "__main__":
    main(sys.argv[-2], int(sys.argv[-1]))
    # as the CLI ends a rank (two_rank_script.py): exit handlers, then no interpreter teardown, where a
    # rank aborted in CI ("terminate called without an active exception", exit -6) after both had passed
    dist.barrier()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    os._exit(0)
