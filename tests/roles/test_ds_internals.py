"""Each `roles/ds_internals.py` function on tiny real engines (ZeRO stages 0-3, fp32 and fp16; one
process, CPU): a DeepSpeed upgrade that moves an internal fails here, under the function's name.
Where DeepSpeed has a public (per-parameter, slower) accessor for the same numbers, the fast path is
checked against it."""

import pytest
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_local_fp32_param

from tests.roles.helpers import Cfg, ds_config, make_batch
from verl_ds.roles import Actor, iter_full_params, load_causal_lm
from verl_ds.roles import ds_internals as dsi

CASES = [(stage, dtype) for stage in (0, 1, 2, 3) for dtype in ("fp32", "fp16")]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
WHERE = f"(ds_internals.py was written for DeepSpeed {dsi.DEEPSPEED_VERSION})"


def _norm(tensors) -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.detach().float().reshape(-1) for t in tensors])))


def _actor(model_dir: str, stage: int, dtype: str) -> Actor:
    # hysteresis 1: one overflow halves the fp16 scale
    return Actor(load_causal_lm(model_dir), ds_config("actor", stage, dtype, hysteresis=1), Cfg())


def _accumulate(actor: Actor) -> None:
    """One mini-batch's forward/backward up to the boundary: the step is pending."""
    batch = make_batch(actor.module.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    batch = batch.replace(old_logprobs=torch.zeros(4, 3), advantages=torch.randn(4, 3, generator=g))
    actor.accumulate(batch, global_tokens=float(batch.loss_mask.sum()), global_seqs=4.0)


@pytest.fixture(scope="module", params=CASES, ids=[f"zero{s}-{d}" for s, d in CASES])
def pending(request, tiny_model_dir):
    """(stage, dtype, actor) with a boundary backward done and its step pending (read-only tests)."""
    stage, dtype = request.param
    actor = _actor(tiny_model_dir, stage, dtype)
    _accumulate(actor)
    return stage, dtype, actor


def _share(actor: Actor) -> int:
    """This rank's share of the trainable elements (one rank: all of them)."""
    return sum(dsi.full_numel(p) for p in actor.module.parameters() if p.requires_grad)


def test_is_zero3(pending):
    stage, _, actor = pending
    assert dsi.is_zero3(actor.module) == (stage == 3), WHERE


def test_full_numel_and_local_tensor(pending, tiny_model_dir):
    stage, dtype, actor = pending
    want = sum(p.numel() for p in load_causal_lm(tiny_model_dir).parameters())
    assert sum(dsi.full_numel(p) for p in actor.module.parameters()) == want, WHERE
    for p in actor.module.parameters():
        t = dsi.local_tensor(p)
        assert t.dtype == DTYPES[dtype] and t.numel() == dsi.full_numel(p), WHERE  # one rank: the whole tensor
        if stage == 3:
            assert p.numel() == 0 and t.data_ptr() != p.data.data_ptr(), "ZeRO-3: ds_tensor is the partition"
        else:
            assert t.data_ptr() == p.data.data_ptr()


def test_grad_partitions(pending):
    stage, dtype, actor = pending
    grads = dsi.grad_partitions(actor.engine)
    assert grads and all(torch.is_tensor(g) and torch.isfinite(g).all() for g in grads), WHERE
    assert sum(g.numel() for g in grads) == _share(actor), WHERE
    assert {g.dtype for g in grads} == {DTYPES[dtype]}, WHERE
    if stage == 3:
        assert len(grads) == 1, "ZeRO-3: one flat buffer"
    # the same numbers DeepSpeed's public per-parameter accessor assembles (loss-scaled alike)
    public = [safe_get_full_grad(p) for p in actor.module.parameters()]
    assert _norm(grads) == pytest.approx(_norm([g for g in public if g is not None]), rel=1e-3), WHERE
    assert [g.data_ptr() for g in actor.grad_partitions()] == [g.data_ptr() for g in grads]  # Role delegates


def test_master_params(pending):
    stage, _, actor = pending
    masters = dsi.master_params(actor.engine)
    assert masters and all(m.dtype == torch.float32 for m in masters), WHERE
    assert sum(m.numel() for m in masters) == _share(actor), WHERE
    # they hold the weights (fp16: their fp32 originals), as the public accessors and the export see
    full = _norm(t for _, t in iter_full_params(actor.engine))
    assert _norm(masters) == pytest.approx(full, rel=1e-3), WHERE
    if stage == 3:
        public = [safe_get_local_fp32_param(p) for p in actor.module.parameters()]
    elif stage in (1, 2):
        public = [safe_get_full_fp32_param(p) for p in actor.module.parameters()]
    else:
        public = None  # stage 0: the torch optimizer's own params (public API) are the masters
    if public is not None:
        assert _norm(masters) == pytest.approx(_norm(public), rel=1e-6), WHERE


def test_torch_optimizer(pending):
    _, _, actor = pending
    assert isinstance(dsi.torch_optimizer(actor.engine.optimizer), torch.optim.Optimizer), WHERE


def test_loss_scale_is_the_configured_initial_scale(pending):
    _, dtype, actor = pending
    want = 2.0 ** actor.ds_config["fp16"]["initial_scale_power"] if dtype == "fp16" else 1.0
    assert dsi.loss_scale(actor.engine.optimizer) == want, WHERE
    assert dsi.overflowed(actor.engine.optimizer) is False, WHERE
    assert actor.precision_stats()["loss_scale"] == want


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_planted_inf_reaches_the_step(tiny_model_dir, stage):
    """`grad_partitions` is the storage the step reads: an inf written there (`Role.force_skip`)
    makes DeepSpeed skip the step, set `overflow` and halve the loss scale."""
    actor = _actor(tiny_model_dir, stage, "fp16")
    _accumulate(actor)
    scale = dsi.loss_scale(actor.engine.optimizer)
    assert not actor.has_overflow()
    actor.force_skip()
    assert actor.has_overflow(), WHERE
    actor.step()
    assert actor.engine.skipped_steps == 1, WHERE
    assert dsi.overflowed(actor.engine.optimizer) is True, WHERE
    assert dsi.loss_scale(actor.engine.optimizer) == scale / 2, WHERE


def test_backward_allreduce_switch(tiny_model_dir):
    """fp32 ZeRO-0 on CPU: the role turns DeepSpeed's backward all-reduce off (BucketAllReduce runs
    instead), and DeepSpeed's backward still obeys the flag."""
    actor = _actor(tiny_model_dir, 0, "fp32")
    assert dsi.backward_allreduce(actor.engine) is False and actor._reducer is not None
    calls = []
    actor.engine.allreduce_gradients = lambda *a, **k: calls.append(1)  # one rank: nothing to reduce
    _accumulate(actor)
    assert calls == [], f"the flag no longer stops DeepSpeed's all-reduce {WHERE}"
    dsi.set_backward_allreduce(actor.engine, True)
    actor._reducer = None
    actor.step()
    _accumulate(actor)
    assert calls, f"the flag no longer switches DeepSpeed's all-reduce {WHERE}"
    other = _actor(tiny_model_dir, 2, "fp32")
    assert dsi.backward_allreduce(other.engine) is True  # left to DeepSpeed everywhere else


def test_enable_cpu_fp16():
    """After it (a fp16 role on CPU calls it), DeepSpeed's accelerator accepts fp16."""
    from deepspeed.accelerator import get_accelerator

    dsi.enable_cpu_fp16()
    assert get_accelerator().is_fp16_supported(), WHERE
    assert torch.float16 in get_accelerator().supported_dtypes(), WHERE


def test_iter_gathered_gathers_one_module_at_a_time(pending):
    stage, _, actor = pending
    names = []
    for mod_name, _, own in dsi.iter_gathered(actor.module):
        for n, p in own:
            names.append(f"{mod_name}.{n}" if mod_name else n)
            assert p.numel() == dsi.full_numel(p), f"not gathered inside the walk {WHERE}"
    assert sorted(names) == sorted(n for n, _ in actor.module.named_parameters())  # each once, tied once
    if stage == 3:
        assert all(p.numel() == 0 for p in actor.module.parameters()), "ZeRO-3: released after the walk"


def test_iter_gathered_whole_and_drop():
    """`whole`: a module's subtree in one piece (its children then yield nothing); `drop`: never yielded."""
    inner = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(torch.nn.Sequential(inner, torch.nn.Linear(2, 1)), torch.nn.Linear(1, 1))
    got = {name: [n for n, _ in own] for name, _, own in dsi.iter_gathered(model)}
    assert got == {"0.0": ["weight", "bias"], "0.1": ["weight", "bias"], "1": ["weight", "bias"]}
    whole = {name: [n for n, _ in own] for name, _, own in dsi.iter_gathered(model, whole=lambda m: m is model[0])}
    assert whole == {"0": ["0.weight", "0.bias", "1.weight", "1.bias"], "1": ["weight", "bias"]}
    dropped = dict(
        (name, [n for n, _ in own])
        for name, _, own in dsi.iter_gathered(model, drop=lambda m: list(m.parameters()) if m is inner else [])
    )
    assert dropped == {"0.1": ["weight", "bias"], "1": ["weight", "bias"]}


def test_storage_tensors():
    """torchao's int8 weight-only Linear weight is a wrapper subclass: its storage is an int8 [out, in]
    tensor plus one scale and zero point per output row, not the fp32 its `dtype` names."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    q = torch.nn.Sequential(torch.nn.Linear(8, 4))
    quantize_(q, Int8WeightOnlyConfig())
    inner = dsi.storage_tensors(q[0].weight)
    assert q[0].weight.dtype == torch.float32 and q[0].weight.element_size() == 4
    assert [(t.dtype, tuple(t.shape)) for t in inner] == [
        (torch.int8, (4, 8)),
        (torch.float32, (4, 1)),
        (torch.int8, (4, 1)),
    ]
    assert all(type(t) is torch.Tensor for t in inner)
    plain = torch.nn.Linear(8, 4).weight
    assert dsi.storage_tensors(plain) == [plain]
