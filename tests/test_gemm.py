"""16-bit GEMMs as fp32 products on a CPU without 16-bit kernels (verl_ds/gemm.py): the arithmetic,
the decision (`precision.cpu_gemm`) and that the trainer's passes run under it."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

from tests.config.test_config import A100, AVX2, AVX512_BF16
from verl_ds.config import load_config
from verl_ds.gemm import Fp32Gemm, fp32_gemm
from verl_ds.precision import PrecisionConfig, resolve_precision
from verl_ds.roles.base import RoleObserver
from verl_ds.trainer.rl_trainer import RLTrainer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16bit_linear_is_the_fp32_product_of_its_operands_rounded_once(dtype):
    torch.manual_seed(0)
    x, w, b = (torch.randn(*s).to(dtype) for s in ((8, 64), (32, 64), (32,)))
    x.requires_grad_(True)
    with Fp32Gemm((dtype,)) as mode:
        y = F.linear(x, w, b)
        y.float().sum().backward()
    assert mode.calls == 1 and y.dtype == dtype
    want = F.linear(x.detach().float(), w.float(), b.float())
    assert torch.equal(y, want.to(dtype))  # one rounding of the fp32 result
    # as close to ATen's own 16-bit kernel as two roundings of one sum can be
    eps = torch.finfo(dtype).eps
    native = F.linear(x.detach(), w, b).float()
    assert ((native - y.float()).abs() <= 2 * eps * want.abs() + 1e-3).all()
    # the gradient reaches the 16-bit input, in its dtype: ones @ w in fp32, rounded
    assert x.grad.dtype == dtype
    # rtol: one rounding; atol: fp32 summation order (the autograd mm's) near zero
    torch.testing.assert_close(x.grad.float(), torch.ones(8, 32) @ w.float(), rtol=eps, atol=1e-5)


def test_attention_and_matmul_run_in_fp32_and_other_dtypes_pass_through():
    q, k, v = (torch.randn(1, 2, 5, 8).bfloat16() for _ in range(3))
    with Fp32Gemm((torch.bfloat16,)) as mode:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mm = q @ k.transpose(-1, -2)
        torch.matmul(q.float(), k.float().transpose(-1, -2))  # fp32: untouched
    assert mode.calls == 2 and out.dtype == mm.dtype == torch.bfloat16
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).bfloat16()
    assert torch.equal(out, want)
    assert isinstance(fp32_gemm(()), contextlib.nullcontext)  # nothing to run in fp32: no mode


@pytest.mark.parametrize(
    "hw,mode,want",
    [
        (AVX2, "auto", ("bf16", "fp16")),  # no 16-bit kernels: both
        (AVX512_BF16, "auto", ("fp16",)),  # bf16 native here; fp16 has none on any CPU
        (AVX2, "native", ()),
        (AVX512_BF16, "fp32", ("bf16", "fp16")),
        (A100, "fp32", ()),  # a GPU's 16-bit GEMMs already are fp32 products
    ],
)
def test_which_dtypes_run_as_fp32_products(hw, mode, want):
    p = PrecisionConfig(actor_dtype="bf16", reference_dtype="fp16", rollout_dtype="bf16", cpu_gemm=mode)
    assert resolve_precision(p, hw, log_choice=False).fp32_gemm == want
    fp32 = PrecisionConfig(actor_dtype="fp32", reference_dtype="fp32", buffer_dtype="fp32", cpu_gemm="fp32")
    assert resolve_precision(fp32, AVX2, log_choice=False).fp32_gemm == ()  # nothing 16-bit to run


class ModeSeen(RoleObserver):
    def __init__(self):
        self.modes = []

    def on_score(self, role, batch, args, out):
        self.modes.append([type(m).__name__ for m in _get_current_function_mode_stack()])


@pytest.mark.parametrize("cpu_gemm,want", [("fp32", ["Fp32Gemm"]), ("native", [])])
def test_the_trainers_passes_run_under_the_resolved_gemm(tmp_path, cpu_gemm, want):
    cfg = load_config(
        None,
        [
            "rollout.engine=hf",
            "trainer.steps=1",
            "trainer.prompts_per_step=2",
            "rollout.n=2",
            "rollout.max_new_tokens=4",
            "roles.actor.micro_batch_size=4",
            "roles.reference.micro_batch_size=4",
            "precision.actor_dtype=bf16",
            "precision.reference_dtype=bf16",
            f"precision.cpu_gemm={cpu_gemm}",
            f"trainer.run_dir={tmp_path}",
            "logging.wandb.mode=disabled",
            "model.tiny.hidden=32",
            "model.tiny.ffn=64",
        ],
    )
    with RLTrainer(cfg) as trainer:
        seen = ModeSeen()
        trainer.reference.observers.append(seen)
        m = trainer.step()
        assert trainer.precision.fp32_gemm == (("bf16",) if cpu_gemm == "fp32" else ())
    assert seen.modes and all(s == want for s in seen.modes)
    assert m["actor/pg_loss"] == m["actor/pg_loss"]  # a finite step
    assert _get_current_function_mode_stack() == []  # nothing left pushed after the step
