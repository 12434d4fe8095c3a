"""`sdpa_cpu16`: SDPA, except where a 16-bit attention on a CPU will be backpropagated.

torch's fused CPU attention (`_scaled_dot_product_flash_attention_for_cpu`) is the fastest forward in
every dtype, but its bf16/fp16 backward is several times slower than the plain matmul-softmax-matmul
it replaces (docs/BENCHMARKS.md, "Token budgets by default"). So the policy models register one
attention implementation with transformers that picks per call: a query that requires grad, on a
CPU, in a 16-bit dtype runs the model's own eager attention (softmax in fp32);
everything else (no-grad scoring, fp32, GPUs) runs transformers' SDPA unchanged. The mask is built
once per forward in the form its attention uses (transformers' mask functions, so packed rows and
shared prompts are masked as before): SDPA's boolean one (or none for a plain causal pass), or, for a
16-bit CPU forward under grad, eager attention's additive one (added to the scores, nothing to save
for the backward).
"""

from __future__ import annotations

import sys

import torch

NAME = "sdpa_cpu16"
_LOW = (torch.bfloat16, torch.float16)


def _math_pays(dtype: torch.dtype, device) -> bool:
    return torch.device(device).type == "cpu" and dtype in _LOW


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

    if torch.is_grad_enabled() and _math_pays(dtype, device):
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
