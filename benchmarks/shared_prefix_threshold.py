"""Where sharing a prefix starts to pay: one micro-batch's forward + backward (the actor's update pass) and
its no-grad forward (a scoring pass), plain (`trim_padding`'s padded rows) against shared (`roles/prefix.py`:
the pack under its mask, the trie and the mask built inside the timing), for n rows of one P-token prompt
with R-token answers, on the quickstart's tiny model and on SmolLM2-135M (when converted). Prints a Markdown
table: seconds each way (median of `--reps`, the sides interleaved) and the tokens sharing saves.

    source launch/env.sh && python benchmarks/shared_prefix_threshold.py
    python benchmarks/shared_prefix_threshold.py --prompts 4 16 64 256 --n 8 --answer 16 --dtype bf16

`model.share_prefix_min_tokens` (the tokens a micro-batch must save before it shares) is read from this table:
below the saved tokens where shared stops being slower, the fixed cost of the trie and the mask wins.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from verl_ds.data.tiny import build_tiny_llama
from verl_ds.roles import prefix
from verl_ds.roles.base import trim_padding
from verl_ds.roles.batch import TrainBatch
from verl_ds.roles.policy import load_causal_lm

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = ROOT / "runs/smollm2-135m-instruct"


def rows(vocab: int, n: int, p: int, r: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (p,), generator=g)
    ids = torch.cat([prompt.expand(n, p), torch.randint(3, vocab, (n, r), generator=g)], 1)
    mask = torch.ones_like(ids)
    return TrainBatch(ids, mask, mask[:, p:].float())


def plain(model, batch: TrainBatch, grad: bool) -> float:
    t0 = time.perf_counter()
    with torch.set_grad_enabled(grad):
        inputs, r = trim_padding(batch)
        width = inputs["input_ids"].shape[1]
        keep = torch.arange(width - r - 1, width - 1)
        logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits
        if grad:
            torch.log_softmax(logits.float(), -1).mean().backward()
    return time.perf_counter() - t0


def shared(model, batch: TrainBatch, grad: bool, implementation: str, dtype) -> float:
    t0 = time.perf_counter()
    with torch.set_grad_enabled(grad):
        take = prefix.held_columns(batch.attention_mask, batch.response_width)
        pack = prefix.pack(batch.input_ids, take)
        keep, _ = pack.response(batch.response_width)
        mask = prefix.attention_mask(pack, implementation, dtype)
        logits = model(**pack.inputs(mask), use_cache=False, logits_to_keep=keep).logits
        if grad:
            torch.log_softmax(logits.float(), -1).mean().backward()
    return time.perf_counter() - t0


def measure(name: str, model, a) -> list[str]:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    model = model.to(dtype)
    impl = model.config._attn_implementation
    out = []
    for p in a.prompts:
        batch = rows(model.config.vocab_size, a.n, p, a.answer)
        for grad in (True, False):
            times = {"plain": [], "shared": []}
            for _ in range(a.reps + 1):  # the first of each: warm-up
                times["plain"].append(plain(model, batch, grad))
                times["shared"].append(shared(model, batch, grad, impl, dtype))
                model.zero_grad(set_to_none=True)
            t_plain, t_shared = (statistics.median(v[1:]) for v in times.values())
            saved = a.n * (p + a.answer) - (p + a.n * a.answer)
            out.append(
                f"| {name} | {'update' if grad else 'score'} | {p} | {saved} | {1e3 * t_plain:.1f} | "
                f"{1e3 * t_shared:.1f} | {t_shared / t_plain:.2f}x |"
            )
            print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--out", type=Path, default=ROOT / "runs/bench_shared_prefix_threshold")
    a = ap.parse_args()
    torch.manual_seed(0)
    head = [
        f"n = {a.n} rows, {a.answer}-token answers, {a.dtype}, {torch.get_num_threads()} threads",
        "",
        "| model | pass | prompt tokens | tokens saved | plain ms | shared ms | shared / plain |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(head), flush=True)
    tiny = build_tiny_llama(a.out / "tiny", hidden=128, layers=2, heads=4, ffn=256)  # the quickstart's model
    lines = measure("tiny (hidden 128, 2 layers)", load_causal_lm(str(tiny), attn_implementation="sdpa_cpu16"), a)
    if (SMOLLM2 / "config.json").exists():
        model = load_causal_lm(str(SMOLLM2), attn_implementation="sdpa_cpu16")
        lines += measure("SmolLM2-135M (hidden 576, 30 layers)", model, a)
    print("\n".join(head + lines))


if __name__ == "__main__":
    main()
