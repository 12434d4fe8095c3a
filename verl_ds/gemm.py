"""bf16/fp16 matrix products on a CPU that has no kernels for them, at fp32 speed.

Without avx512_bf16/AMX (bf16) or AVX512-FP16/AMX-FP16 (fp16), ATen runs 16-bit GEMMs in a
generic loop that is an order of magnitude slower than its fp32 GEMM (docs/BENCHMARKS.md,
"16-bit GEMMs on a CPU without 16-bit kernels"). `fp32_gemm(dtypes)` runs each such product on fp32 copies of
its 16-bit operands and rounds the result to the operands' dtype once. That is the arithmetic of
16-bit hardware (tensor cores, AMX, avx512_bf16): the product of two 16-bit numbers is exact in
fp32, sums accumulate in fp32, the output is rounded to 16 bits; only the summation order differs,
as it does between any two kernels. Everything else (norms, activations, softmax outside attention,
the weights and activations kept between ops) stays 16-bit.

Autograd sees the casts: backward runs fp32 GEMMs and rounds each gradient to 16 bits where its
tensor is 16-bit, as a 16-bit kernel's backward does. `resolve_precision` decides the dtypes
(`precision.cpu_gemm`); the RL trainer enters the context around its step and its validation, the
SFT trainer (`cpu_gemm=`) around its fit.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from verl_ds.precision import TORCH_DTYPES

# The products a transformer's forward and backward spend their time in: linear layers, attention
# (fused, or as matmul/bmm in eager attention), and the LM head.
GEMMS = frozenset(
    {
        F.linear,
        F.scaled_dot_product_attention,
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.addmm,
        torch.baddbmm,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.mm,
        torch.Tensor.bmm,
    }
)


class Fp32Gemm(TorchFunctionMode):
    """Runs every GEMM whose first tensor operand is a CPU tensor of one of `dtypes` in fp32 and
    rounds its result back. Other calls pass through untouched."""

    def __init__(self, dtypes: tuple[torch.dtype, ...]):
        super().__init__()
        self.dtypes = frozenset(dtypes)
        self.calls = 0  # GEMMs run in fp32 (tests check the mode engaged)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMMS:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None and first.dtype in self.dtypes and first.device.type == "cpu":
                self.calls += 1
                up = lambda x: x.float() if isinstance(x, torch.Tensor) and x.dtype in self.dtypes else x  # noqa: E731
                out = func(*map(up, args), **{k: up(v) for k, v in kwargs.items()})
                return out.to(first.dtype)
        return func(*args, **kwargs)


def fp32_gemm(dtypes: tuple[str, ...]) -> contextlib.AbstractContextManager:
    """The context for a resolved `precision.fp32_gemm` (dtype names); a no-op when empty."""
    if not dtypes:
        return contextlib.nullcontext()
    return Fp32Gemm(tuple(TORCH_DTYPES[d] for d in dtypes))
