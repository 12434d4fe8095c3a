"""`sdpa_cpu16`: SDPA for every pass except a 16-bit CPU pass under grad, which runs the plain math."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from verl_ds.roles.attention import register

pytestmark = pytest.mark.numerics  # asserts bitwise equalities of kernels: rerun with AVX2 kernels


class CountFusedBackward(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += "flash_attention_for_cpu_backward" in str(func)
        return func(*args, **(kwargs or {}))


def _models(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    register()
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    state = LlamaForCausalLM(cfg).state_dict()
    out = {}
    for impl in ("sdpa", "eager", "sdpa_cpu16"):
        m = LlamaForCausalLM(LlamaConfig(**cfg.to_dict(), attn_implementation=impl))
        m.load_state_dict(state)
        out[impl] = m.to(dtype)
    return out


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding, as the trainer's rows
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return dict(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)


def _train(model, batch):
    """Sum of the real tokens' logprobs, its gradient, and how many fused CPU attention backwards ran."""
    model.zero_grad(set_to_none=True)
    logits = model(**batch).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    loss = (lp * batch["attention_mask"][:, 1:]).sum()
    with CountFusedBackward() as count:
        loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}, count.n


def test_a_16bit_cpu_pass_under_grad_is_sdpas_forward_with_the_maths_backward():
    """Every forward is SDPA's, bitwise (the rollout's kernel: a matched pair's first-epoch logprobs are
    the rollout's); a 16-bit CPU backward is the eager math's (no fused backward runs), so its gradients
    differ from eager's by no more than SDPA's own gradients do (rounding of the same function)."""
    batch = _batch()
    m = _models(torch.bfloat16)
    with torch.no_grad():  # scoring: SDPA's fused kernel, bitwise
        torch.testing.assert_close(m["sdpa_cpu16"](**batch).logits, m["sdpa"](**batch).logits, rtol=0, atol=0)
    loss, grads, fused = _train(m["sdpa_cpu16"], batch)
    eager_loss, eager_grads, _ = _train(m["eager"], batch)
    sdpa_loss, sdpa_grads, sdpa_fused = _train(m["sdpa"], batch)
    assert sdpa_fused > 0 and fused == 0  # the slow fused backward is what it avoids
    assert loss == sdpa_loss  # under grad too: SDPA's forward, bitwise
    for k, gr in grads.items():
        ours = float((gr.float() - eager_grads[k].float()).abs().max())
        sdpa = float((sdpa_grads[k].float() - eager_grads[k].float()).abs().max())
        scale = float(eager_grads[k].float().abs().max())
        assert ours <= max(2 * sdpa, 16 * 2**-8 * scale), (k, ours, sdpa, scale)

    m = _models(torch.float32)  # fp32: SDPA everywhere, bitwise (its fused backward is the fast one)
    loss, grads, fused = _train(m["sdpa_cpu16"], batch)
    sdpa_loss, sdpa_grads, _ = _train(m["sdpa"], batch)
    assert fused > 0 and loss == sdpa_loss
    for k, gr in grads.items():
        torch.testing.assert_close(gr, sdpa_grads[k], rtol=0, atol=0, msg=k)
