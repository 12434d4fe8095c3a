"""`sdpa_cpu16`: SDPA, except where a 16-bit attention on a CPU will be backpropagated.

torch's fused CPU attention (`_scaled_dot_product_flash_attention_for_cpu`) is the fastest forward in
every dtype, but its bf16/fp16 backward is several times slower than the plain matmul-softmax-matmul
it replaces (docs/BENCHMARKS.md, "Token budgets by default"). So the policy models register one
attention implementation with transformers that picks per call: a query that requires grad, on a
CPU, in a 16-bit dtype runs the explicit math (softmax in fp32, as transformers' eager attention);
everything else (no-grad scoring, fp32, GPUs) runs transformers' SDPA unchanged. The mask is built
once per forward in the form its attention uses (transformers' mask functions, so packed rows and
shared prompts are masked as before): SDPA's boolean one (or none for a plain causal pass), or, for a
16-bit CPU forward under grad, eager attention's additive one (added to the scores, nothing to save
for the backward).
"""

from __future__ import annotations

import torch

NAME = "sdpa_cpu16"
_LOW = (torch.bfloat16, torch.float16)


def needs_math(query: torch.Tensor) -> bool:
    """The explicit math pays exactly here: a 16-bit CPU attention whose backward will run."""
    return query.requires_grad and query.device.type == "cpu" and query.dtype in _LOW


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention signature: `query` `[B, H, Q, D]`, `key`/`value` `[B, H_kv, K, D]`,
    `attention_mask` `[B, 1, Q, K]` bool (True: attend) or None -> (`[B, Q, H, D]`, None)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if not needs_math(query):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    q_len, k_len = query.shape[2], key.shape[2]
    if attention_mask is None and q_len > 1 and (is_causal if is_causal is not None else module.is_causal):
        # SDPA's is_causal: aligned top-left, as transformers only drops the mask when Q == K
        attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril()
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        # finite, not -inf: a fully masked (padding) row stays finite
        attention_mask = torch.zeros((), dtype=query.dtype).masked_fill(~attention_mask, torch.finfo(query.dtype).min)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    weights = torch.matmul(query, key.transpose(2, 3)) * scale
    if attention_mask is not None:
        weights = weights + attention_mask
    probs = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def mask(*args, dtype: torch.dtype = torch.float32, device="cpu", **kwargs):
    """transformers' mask function for this implementation: the additive mask where the attention
    will run the math (a 16-bit CPU forward under grad), SDPA's elsewhere."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    if torch.is_grad_enabled() and torch.device(device).type == "cpu" and dtype in _LOW:
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
