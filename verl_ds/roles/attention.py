"""`sdpa_cpu16`: SDPA, except where a 16-bit attention on a CPU will be backpropagated (and is small).

torch's fused CPU attention (`_scaled_dot_product_flash_attention_for_cpu`) is the fastest forward in
every dtype, but its bf16/fp16 backward is several times slower than the plain matmul-softmax-matmul
it replaces (docs/BENCHMARKS.md, "Token budgets by default"). So the policy models register one
attention implementation with transformers that picks per call: a query that requires grad, on a
CPU, in a 16-bit dtype runs the model's own eager attention (softmax in fp32);
everything else (no-grad scoring, fp32, GPUs) runs transformers' SDPA unchanged. The mask is built
once per forward in the form its attention uses (transformers' mask functions, so packed rows and
shared prompts are masked as before): SDPA's boolean one (or none for a plain causal pass), or, for a
16-bit CPU forward under grad, eager attention's additive one (added to the scores, nothing to save
for the backward). Long rows (past `MATH_MAX_ELEMENTS`) take SDPA in every pass: the math's
probabilities grow with the square of the row.
"""

from __future__ import annotations

import sys

import torch

NAME = "sdpa_cpu16"
_LOW = (torch.bfloat16, torch.float16)


# The plain math keeps each layer's [rows, heads, q, k] probabilities (fp32 softmax) for its backward:
# quadratic in the row length, where the fused kernel's memory is linear. Past this many mask elements
# (rows x q x k; 4k-token rows x 1) the fused kernel runs the backward too, slower but in bounded
# memory, so long rows fit (docs/BENCHMARKS.md, "Long rows").
MATH_MAX_ELEMENTS = 1 << 24


def _math_pays(dtype: torch.dtype, device) -> bool:
    return torch.device(device).type == "cpu" and dtype in _LOW


def math_runs(dtype: torch.dtype, device, rows: int, q: int, k: int, grad: bool = True) -> bool:
    """Whether this implementation runs a pass of `rows` x `q` queries over `k` keys as the plain math
    (the memory model's question: its attention memory is then quadratic)."""
    return grad and _math_pays(dtype, device) and rows * q * k <= MATH_MAX_ELEMENTS


def attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention signature (`query` `[B, H, Q, D]`, `key`/`value` `[B, H_kv, K, D]`) ->
    (`[B, Q, H, D]`, weights or None). A 16-bit CPU query that requires grad runs the model's own
    eager attention (its modeling module's `eager_attention_forward`: softcapping, sliding windows
    and the like as the model defines them) on the additive mask `mask` built for it; anything else,
    or a model without an eager function, runs transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    additive = attention_mask is not None and attention_mask.is_floating_point()
    if eager is not None and additive and query.requires_grad and _math_pays(query.dtype, query.device):
        return eager(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def mask(*args, dtype: torch.dtype = torch.float32, device="cpu", **kwargs):
    """transformers' mask function for this implementation: the additive mask where the attention
    will run the math (a 16-bit CPU forward under grad), SDPA's elsewhere."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    given = {**dict(zip(("batch_size", "q_length", "kv_length"), args)), **kwargs}
    size = (given["batch_size"], given["q_length"], given["kv_length"])
    if math_runs(dtype, device, *size, grad=torch.is_grad_enabled()):
        return eager_mask(*args, dtype=dtype, device=device, **kwargs)
    return sdpa_mask(*args, device=device, **kwargs)


def register() -> str:
    """Make `attn_implementation="sdpa_cpu16"` known to transformers (idempotent) -> the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, mask)
    return NAME
