"""16-bit GEMMs on this CPU: ATen's own kernels against verl_ds/gemm.py's fp32 products, in one run.

    source launch/env.sh && python benchmarks/cpu_gemm.py                # SmolLM2-135M's shape
    python benchmarks/cpu_gemm.py --layers 4 --dtypes bf16 fp16          # shorter

One forward + backward of a randomly initialised Llama of SmolLM2-135M's shape (hidden 576, 9 heads,
3 KV heads, FFN 1536, vocabulary 49152) on `--batch` x `--tokens` tokens, per dtype: fp32, the 16-bit
dtype with ATen's kernels (`native`), and under `Fp32Gemm` (`fp32 products`). Prints seconds and the
ratio to fp32. On a CPU without avx512_bf16/AMX the native 16-bit runs are an order of magnitude
slower; with them, bf16 native is the faster one.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from verl_ds.gemm import fp32_gemm  # noqa: E402
from verl_ds.precision import TORCH_DTYPES  # noqa: E402


def fwd_bwd_s(model, ids, ctx) -> float:
    def once():
        logits = model(input_ids=ids).logits
        torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).mean().backward()

    with ctx:
        once()  # warm-up (allocator, first-call dispatch)
        t = time.perf_counter()
        once()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=120)
    p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp16"])
    a = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=576, num_hidden_layers=a.layers, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.tokens))
    base = LlamaForCausalLM(cfg)
    runs = [("fp32", "-", base, contextlib.nullcontext())]
    for d in a.dtypes:
        m = LlamaForCausalLM(cfg).to(TORCH_DTYPES[d])
        runs += [(d, "native", m, contextlib.nullcontext()), (d, "fp32 products", m, fp32_gemm((d,)))]
    print(f"| dtype | GEMMs | fwd+bwd s ({a.layers} layers, {a.batch}x{a.tokens} tokens) | vs fp32 |")
    print("|---|---|---|---|")
    ref = None
    for d, how, model, ctx in runs:
        s = fwd_bwd_s(model, ids, ctx)
        ref = ref or s
        print(f"| {d} | {how} | {s:.2f} | {s / ref:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
