"""Sequence parallelism on CPU: the actor update's per-rank peak memory and speed at SP 2 against SP 1, on
2 ranks under the deepspeed launcher, for rows of several lengths. Prints a Markdown table (ratios from one run).

    source launch/env.sh && python benchmarks/sp_memory.py                 # 4k 8k rows, bf16, checkpointing on
    python benchmarks/sp_memory.py --lengths 16384 --dtype fp32 --limit-gib 6  # rows under a memory cap

The model is SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536, vocab 49,152, tied embeddings) with 8
attention heads of 72 and 2 key/value heads instead of 9 of 64 and 3: DeepSpeed's all-to-all hands each
rank whole heads, and 9 do not split over 2 ranks (the real SmolLM2 runs at SP 3). Random weights: memory
and time do not depend on their values. SP 1 is 2
data-parallel ranks, each 2 whole rows; SP 2 is one group, its 2 rows each split over both ranks (2
micro-batches a rank either way, so the gradient accumulation is alike). Each rank:
an Actor (`verl_ds.roles`, ZeRO-3, gradient checkpointing as long-row runs use it) runs a short warm-up
update (the optimizer states appear), then a measured one on the long rows: its peak resident memory
(sampled every 2 ms) above the resident memory just before it, free heap pages returned (the floor: weights, optimizer
states, buffers), and its seconds.
`--allocator`: what the resident memory counts. `live` (default): glibc with a fixed mmap threshold, so every
large tensor is its own mapping and goes back to the kernel when freed: the peak follows the live tensors.
`glibc`: glibc's defaults (its threshold grows as large blocks are freed, and freed ones then stay in the
heap: the peak counts what the heap keeps). `tcmalloc`: the allocator `launch/train.sh` runs the ranks with
(its page cache counts). The same update measured three ways on one host differs by several fold (docs/BENCHMARKS.md).
`--limit-gib`: each rank's data segment capped (RLIMIT_DATA, which counts the anonymous memory the
tensors live in), so a row that does not fit one rank fails at SP 1 and runs at SP 2.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "runs/smollm2_shape_8heads"


def build_model(path: Path, max_len: int) -> None:
    """SmolLM2-135M's shape with 8 heads of 72 (2 key/value heads), random weights, saved once."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists() and json.loads((path / "config.json").read_text())[
        "max_position_embeddings"
    ] >= max_len:
        return
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        head_dim=72,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


class PeakRSS:
    """The process's resident memory, sampled every 2 ms on a thread, its maximum since `start`."""

    def __init__(self):
        import psutil

        self.proc, self.peak, self._on = psutil.Process(), 0, False

    def rss(self) -> int:
        return self.proc.memory_info().rss

    def start(self) -> int:
        self.peak, self._on = self.rss(), True
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        return self.peak

    def _watch(self) -> None:
        while self._on:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def stop(self) -> int:
        self._on = False
        self._t.join()
        return max(self.peak, self.rss())


def rows_of(length: int, rows: int, seed: int):
    """`rows` random rows of `length` tokens, the last 64 a response (advantages random)."""
    import torch

    from verl_ds.roles.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    resp = 64
    ids = torch.randint(3, 49152, (rows, length), generator=g)
    adv = torch.randn(rows, resp, generator=g)
    return TrainBatch(
        ids, torch.ones(rows, length, dtype=torch.long), torch.ones(rows, resp), advantages=adv, on_policy=True
    )


def worker(sp_size: int, length: int, dtype: str, limit_gib: float) -> None:
    import torch.distributed as dist

    from verl_ds.config import AlgorithmConfig, read_ds_json
    from verl_ds.dist import init_distributed
    from verl_ds.ds_config import render_role
    from verl_ds.precision import Hardware, PrecisionConfig, resolve_precision
    from verl_ds.process import release_free_memory
    from verl_ds.roles import Actor, load_causal_lm
    from verl_ds.roles import attention as attn
    from verl_ds.roles.sequence_parallel import SequenceParallel

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    impl = attn.NAME if dtype != "fp32" else "sdpa"
    model = load_causal_lm(str(MODEL), grad_checkpointing=True, attn_implementation=impl)
    sp = SequenceParallel.register(model, sp_size, impl) if sp_size > 1 else None
    dp = world // sp_size
    rows = 2  # each rank holds 2 rows: its own (SP 1), or its group's (SP 2); 2 micro-batches either way
    prec = resolve_precision(PrecisionConfig(actor_dtype=dtype), Hardware("cpu", cpu_flags=frozenset({"avx2"})))
    ds = render_role(
        "actor",
        {**read_ds_json("actor_zero3_fp32.json", "bench"), "zero_optimization": {"stage": 3}},
        "actor_zero3_fp32.json",
        prec,
        micro_batch_size=1,
        train_batch_size=rows * dp,
        world_size=dp,
        max_grad_norm=1.0,
        optimizer_params={"lr": 1e-6, "weight_decay": 0.0, "betas": [0.9, 0.999]},
        sequence_parallel=sp_size > 1,
    )
    actor = Actor(model, ds, AlgorithmConfig(use_kl_loss=False), sp=sp)  # the policy loss alone
    if limit_gib:
        cap = int(limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    out = {}
    meter = PeakRSS()
    # a short warm-up update first (the optimizer's states appear at its step), then the measured one
    for step, n in (("warmup", 128), ("measured", length)):
        batch = rows_of(n, rows, seed=rank // sp_size)  # a group's ranks hold the same rows
        resp = batch.response_width
        release_free_memory()  # the heap's free pages back to the kernel: a floor of what is held
        floor = meter.start()
        t0 = time.perf_counter()
        actor.accumulate(batch, global_tokens=float(resp * rows * dp), global_seqs=float(rows * dp))
        actor.step()
        secs = time.perf_counter() - t0
        peak = meter.stop()
        out[step] = {"peak_above_floor_mib": (peak - floor) / 2**20, "floor_mib": floor / 2**20, "s": secs}
    out.update(rank=rank, sp=sp_size, length=length, rows=rows)
    print("SP_MEMORY " + json.dumps(out), flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def allocator_env(allocator: str) -> dict:
    if allocator == "live":
        return {"MALLOC_MMAP_THRESHOLD_": "65536"}  # a fixed threshold: glibc stops raising it
    if allocator == "tcmalloc":
        found = subprocess.run(
            ["bash", "-c", f"source {ROOT / 'launch/tcmalloc.sh'} && tcmalloc_path"], capture_output=True, text=True
        ).stdout.strip()
        if not found:
            sys.exit("--allocator tcmalloc: libtcmalloc_minimal.so.4 not found (launch/install.sh installs it)")
        return {"LD_PRELOAD": found}
    return {}


def launch(sp: int, length: int, dtype: str, limit_gib: float, port: int, allocator: str) -> list[dict]:
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(port), __file__, "--worker"]
    cmd += ["--sp", str(sp), "--lengths", str(length), "--dtype", dtype, "--limit-gib", str(limit_gib)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **allocator_env(allocator)}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    # the ranks' lines may interleave: each record read from its marker on
    got = [json.JSONDecoder().raw_decode(part)[0] for part in done.stdout.split("SP_MEMORY ")[1:]]
    if len(got) < 2:
        lines = (done.stdout + done.stderr).splitlines()
        tail = [x for x in lines if "Error:" in x or "out of memory" in x or "Cannot allocate" in x][-2:]
        return [{"sp": sp, "length": length, "failed": f"exit {done.returncode}: {' / '.join(tail)[:200]}"}]
    return got


def table(results: dict, lengths: list[int]) -> str:
    lines = [
        "| row tokens | SP 1 peak above floor, per rank (MiB) | SP 2 (MiB) | SP 2 / SP 1 | SP 1 floor (MiB) "
        "| SP 2 floor | update s, SP 1 / SP 2 | tokens/s SP 2 / SP 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in lengths:
        one, two = results[(1, n)], results[(2, n)]
        if any("failed" in r[0] for r in (one, two)):
            lines.append(f"| {n:,} | {one[0].get('failed', 'ok')} | {two[0].get('failed', 'ok')} | | | | | |")
            continue
        p1 = max(r["measured"]["peak_above_floor_mib"] for r in one)
        p2 = max(r["measured"]["peak_above_floor_mib"] for r in two)
        f1 = max(r["measured"]["floor_mib"] for r in one)
        f2 = max(r["measured"]["floor_mib"] for r in two)
        s1 = max(r["measured"]["s"] for r in one)
        s2 = max(r["measured"]["s"] for r in two)
        # in those seconds SP 1 trains 4 rows (2 a rank), SP 2 trains 2 (the group's, each split)
        lines.append(
            f"| {n:,} | {p1:,.0f} | {p2:,.0f} | **{p2 / p1:.2f}x** | {f1:,.0f} | {f2:,.0f} | {s1:.1f} / {s2:.1f} "
            f"| {s1 / (2 * s2):.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--limit-gib", type=float, default=0.0, help="each rank's data segment cap (0: none)")
    ap.add_argument("--allocator", default="live", choices=("live", "glibc", "tcmalloc"), help="see above")
    ap.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.sp, a.lengths[0], a.dtype, a.limit_gib)
    build_model(MODEL, max(a.lengths))
    results = {}
    for n in a.lengths:
        for sp in (1, 2):
            results[(sp, n)] = launch(sp, n, a.dtype, a.limit_gib, 29700 + sp, a.allocator)
            print(f"SP {sp}, {n} tokens: {json.dumps(results[(sp, n)])}", flush=True)
    print(table(results, a.lengths))


if __name__ == "__main__":
    main()
