"""How much of an Adam step a bf16 (or fp16) compute copy of fp32 master weights sees.

    python benchmarks/bf16_update_visibility.py runs/smollm2-135m-instruct --lr 3e-5 1e-5

Adam moves every coordinate of the fp32 masters by about lr a step (exactly lr in its first step:
m/sqrt(v) = ±1). A 16-bit compute copy is the masters rounded, so a coordinate of it changes only when
the master crosses a rounding boundary. For each lr this prints, from the model's own weights, the
share of 16-bit weights that change after k steps of the same sign and of random signs, and the
16-bit copy's change against the masters' (L2). Pure tensor math on the safetensors file; no training.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def visibility(weights: torch.Tensor, lr: float, steps: list[int], dtype: torch.dtype, seed: int = 0):
    """[(k, sign mode, share of 16-bit coordinates changed, |16-bit change| / |master change|)]."""
    g = torch.Generator().manual_seed(seed)
    start = weights.to(dtype).float()
    out = []
    for mode in ("same sign", "random signs"):
        master = weights.clone()
        sign = torch.where(torch.rand(weights.shape, generator=g) < 0.5, -1.0, 1.0)
        for k in range(1, max(steps) + 1):
            if mode == "random signs" and k > 1:
                sign = torch.where(torch.rand(weights.shape, generator=g) < 0.5, -1.0, 1.0)
            master += sign * lr
            if k in steps:
                low = master.to(dtype).float()
                changed = (low != start).float().mean().item()
                ratio = ((low - start).norm() / (master - weights).norm()).item()
                out.append((k, mode, changed, ratio))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a folder with model.safetensors")
    p.add_argument("--lr", type=float, nargs="+", default=[3e-5, 1e-5])
    p.add_argument("--steps", type=int, nargs="+", default=[1, 3, 10, 30])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--every", type=int, default=4, help="use every n-th weight (the statistics hold; less memory)")
    args = p.parse_args(argv)
    sd = load_file(str(Path(args.model) / "model.safetensors"))
    w = torch.cat([v.float().flatten() for v in sd.values()])[:: args.every].clone()
    print(f"{w.numel()} weights (every {args.every}th), median |w| {w.abs().median().item():.4f}")
    print(f"| lr | steps | signs | {args.dtype} weights changed | |{args.dtype} change| / |master change| |")
    print("|---|---|---|---|---|")
    for lr in args.lr:
        for k, mode, changed, ratio in visibility(w, lr, args.steps, DTYPES[args.dtype]):
            print(f"| {lr:g} | {k} | {mode} | {changed:.1%} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
