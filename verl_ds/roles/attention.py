"""`sdpa_cpu16`: SDPA's forward everywhere; for a short 16-bit attention on a CPU under grad, the plain
math's backward.

torch's fused CPU attention (`_scaled_dot_product_flash_attention_for_cpu`) is the fastest forward in
every dtype, but its bf16/fp16 backward is several times slower than the plain matmul-softmax-matmul
(docs/BENCHMARKS_HISTORY.md, "Against the code before token budgets"). So the policy models register one attention
implementation with transformers: every pass runs transformers' SDPA forward on SDPA's mask, the very
kernel and inputs of the rollout's HF engine and of no-grad scoring, so a matched pair's first-epoch
logprobs equal the rollout's; a 16-bit CPU query that requires grad gets its backward from the model's
own eager attention (matmul, fp32 softmax, matmul: `eager_attention_forward`, softcapping and sliding
windows as the model defines them) recomputed from the saved query, keys and values. Nothing
quadratic is saved for the backward; the recomputation holds one layer's `[rows, heads, q, k]`
probabilities at a time, so past `MATH_MAX_ELEMENTS` mask elements the fused backward runs instead.
The gradient is the math's at the same inputs: it differs from the fused kernel's by rounding only.
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from verl_ds.errors import ConfigError

NAME = "sdpa_cpu16"
_LOW = (torch.bfloat16, torch.float16)

# The math backward recomputes one layer's [rows, heads, q, k] probabilities (fp32 softmax): past this
# many mask elements (rows x q x k; one 4k-token row) the fused backward runs instead, slower but in
# memory linear in the row (docs/BENCHMARKS.md, "Long rows and memory").
MATH_MAX_ELEMENTS = 1 << 24


def _math_pays(dtype: torch.dtype, device) -> bool:
    return torch.device(device).type == "cpu" and dtype in _LOW


def math_runs(dtype: torch.dtype, device, rows: int, q: int, k: int, grad: bool = True) -> bool:
    """Whether a pass of `rows` x `q` queries over `k` keys takes its backward from the plain math (the
    memory model's question: one layer's quadratic probabilities in the backward)."""
    return grad and _math_pays(dtype, device) and rows * q * k <= MATH_MAX_ELEMENTS


def attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention signature (`query` `[B, H, Q, D]`, `key`/`value` `[B, H_kv, K, D]`) ->
    (`[B, Q, H, D]`, None): SDPA's forward; under grad on a 16-bit CPU query of a short pass, with the
    eager math's backward (`_SdpaMathBackward`); a model without an eager function runs plain SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pack = getattr(attention_mask, "prefix_pack", None)
    if pack is not None:  # a shared-prefix pack whose attention runs per row (`prefix.by_path`)
        return by_path(module, query, key, value, pack, **kwargs), None
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    b, _, q, _ = query.shape
    k = key.shape[2]
    square = attention_mask is not None or q == k  # None: causal from the top-left, as the math's mask below
    if eager is not None and square and query.requires_grad and math_runs(query.dtype, query.device, b, q, k):
        out = _SdpaMathBackward.apply(query, key, value, attention_mask, module, eager, kwargs)
        return out, None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def by_path(module, query, key, value, pack, **kwargs) -> torch.Tensor:
    """A shared-prefix pack's attention (`[1, H, N, D]` query, keys and values of its `N` places), run per
    distinct row: each row's path of places (`pack.paths`: its shared prefix and its own tokens, in order)
    gathered into a right-padded row, all rows at once under the causal mask of a plain padded pass; each
    place's output read from the row that lays it out (`pack.owner`, at its position). The same kernel on the
    same layout as the plain pass: each row's outputs are the plain pass's bit for bit. Gradients reach a
    shared place's keys and values from every row through the gather -> `[1, N, H, D]`."""
    valid = pack.paths >= 0
    idx = pack.paths.clamp(min=0)
    rows = lambda t: t[0][:, idx].transpose(0, 1)  # [H, N, D] -> [U, H, L, D]  # noqa: E731
    n = idx.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
    mask = (causal[None] & valid[:, None, :])[:, None]  # [U, 1, L, L]
    out, _ = attention(module, rows(query), rows(key), rows(value), mask, **kwargs)  # [U, L, H, D]
    return out[pack.owner, pack.position_ids][None]


class _SdpaMathBackward(torch.autograd.Function):
    """Forward: transformers' SDPA (the fused kernel). Backward: the eager math recomputed on the saved
    query, keys and values, its additive mask made from SDPA's (boolean, or None for a causal pass)."""

    @staticmethod
    def forward(ctx, query, key, value, attention_mask, module, eager, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        ctx.save_for_backward(query, key, value)
        ctx.mask, ctx.module, ctx.eager, ctx.kwargs = attention_mask, module, eager, kwargs
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            mask = _additive(ctx.mask, query, key.shape[2])
            out, _ = ctx.eager(ctx.module, query, key, value, mask, **ctx.kwargs)
            grads = torch.autograd.grad(out, (query, key, value), grad_out)
        return (*grads, None, None, None, None)


def _additive(mask: torch.Tensor | None, query: torch.Tensor, k: int) -> torch.Tensor:
    """Eager attention's additive mask (0 where attended, the dtype's minimum elsewhere) from SDPA's:
    a boolean `[B, 1, q, k]` one, an additive one as it is, or None (causal, q == k)."""
    low = torch.finfo(query.dtype).min
    if mask is None:
        q = query.shape[2]
        keep = torch.ones(q, k, dtype=torch.bool, device=query.device).tril()[None, None]
    elif mask.dtype == torch.bool:
        keep = mask
    else:
        return mask
    return torch.zeros(keep.shape, dtype=query.dtype, device=query.device).masked_fill_(~keep, low)


def mask(*args, **kwargs):
    """transformers' mask function for this implementation: SDPA's in every pass (the forward is SDPA's;
    the math's backward builds its additive mask from it)."""
    from transformers.masking_utils import sdpa_mask

    kwargs.pop("dtype", None)
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Make `attn_implementation="sdpa_cpu16"` known to transformers (idempotent) -> the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, mask)
    return NAME


def resolve(attn: str, packing, gpu: bool) -> tuple[str, bool]:
    """`model.attn_implementation` and `model.packing` resolved: flash-attention where it runs (a GPU
    and the flash-attn package), SDPA on other GPUs, on CPU SDPA with the plain math for 16-bit
    backward passes (roles/attention.py), and packed rows where the attention runs them without a mask
    (flash-attention's varlen kernels skip what lies between rows; SDPA's masked pack runs it, which
    measured slower than padded rows under token budgets on CPU, docs/BENCHMARKS.md)."""
    has_flash = gpu and importlib.util.find_spec("flash_attn") is not None
    if attn == "auto":
        attn = "flash_attention_2" if has_flash else "sdpa" if gpu else NAME
    elif attn == "flash_attention_2" and not has_flash:
        raise ConfigError(
            "model.attn_implementation",
            "flash_attention_2 needs a CUDA GPU and the flash-attn package (pip install flash-attn); "
            "auto or sdpa run without it",
        )
    return attn, attn == "flash_attention_2" if packing == "auto" else bool(packing)
