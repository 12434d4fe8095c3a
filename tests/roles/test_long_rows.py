"""Long rows on one rank: gradient checkpointing takes effect in the roles' eval mode, and the update's
peak memory is measured (the process's resident high-water mark, reset before the pass)."""

import ctypes
import gc
from contextlib import contextmanager

import pytest
import torch

from tests.roles.helpers import Cfg, accumulated_grads, assert_same_gradients, ds_config
from verl_ds.diagnostics.memory.measure import peak_rss, process_memory, reset_peak
from verl_ds.roles import Actor, load_causal_lm, load_value_model
from verl_ds.roles.base import checkpointed_layers
from verl_ds.roles.batch import TrainBatch

LAYERS, HIDDEN, FFN, ROWS, T, R = 8, 128, 512, 2, 2048, 16


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory):
    from verl_ds.data.tiny import build_tiny_llama

    out = tmp_path_factory.mktemp("deep") / "model"
    return str(build_tiny_llama(out, hidden=HIDDEN, layers=LAYERS, heads=4, ffn=FFN, max_len=T))


def long_batch(vocab: int, rows: int = ROWS, t: int = T, r: int = R) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, t), generator=g)
    adv = torch.randn(rows, r, generator=g)
    return TrainBatch(ids, torch.ones(rows, t, dtype=torch.long), torch.ones(rows, r), advantages=adv, on_policy=True)


def _ready(actor, vocab: int):
    """A short update first: one-off allocations (thread pools, kernel caches) out of the way."""
    accumulated_grads(actor, long_batch(vocab, t=64))


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


@contextmanager
def rss_follows_tensors():
    """glibc keeps freed blocks below its (self-raising) mmap threshold in its heap, so a process's
    resident memory remembers earlier passes and one peak hides behind another. A fixed 64 KiB
    threshold maps every tensor-sized block on its own and unmaps it when freed: resident memory then
    follows the live tensors. Back to glibc's dynamic ceiling (32 MiB) afterwards."""
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(M_MMAP_THRESHOLD, 64 << 10) == 1
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)


def update_peak(actor, batch) -> tuple[float, dict]:
    """(bytes the process's resident memory rose to above where the update started, the gradients)."""
    gc.collect()
    assert reset_peak(), "this kernel cannot reset the resident high-water mark"
    start = process_memory()["rss"]
    grads = accumulated_grads(actor, batch)
    return peak_rss() - start, grads


def test_grad_checkpointing_takes_effect_in_eval_mode_and_bounds_the_update_memory(deep_model_dir):
    """transformers checkpoints a layer only when it is `training`; the roles run in eval mode. With
    checkpointing asked for, every layer recomputes and the update's peak falls to the layer inputs
    plus one layer's working set, with the same gradients; dropout stays off (eval mode's numbers)."""
    on_model = load_causal_lm(deep_model_dir, grad_checkpointing=True)
    assert checkpointed_layers(on_model) == LAYERS
    assert not any(m.training for m in on_model.modules() if isinstance(m, torch.nn.Dropout))
    assert not on_model.training and not on_model.model.layers[0].self_attn.training  # eval mode inside
    ds = ds_config("actor", 0, "fp32", micro=ROWS, total=ROWS)
    vocab = on_model.config.vocab_size
    on, off = Actor(on_model, ds, Cfg()), Actor(load_causal_lm(deep_model_dir), ds, Cfg())
    assert checkpointed_layers(off.module) == 0
    batch = long_batch(vocab)
    with rss_follows_tensors():
        for a in (on, off):
            _ready(a, vocab)
        peak_on, grads_on = update_peak(on, batch)
        peak_off, grads_off = update_peak(off, batch)
        # the checkpointed update again, after the plain one: the first full-length update can hold one-off
        # buffers the short warm-up did not size (a BLAS's packing for these shapes), so the lower peak counts
        peak_on = min(peak_on, update_peak(on, batch)[0])
    assert_same_gradients(grads_on, grads_off)  # recomputation is exact
    # what the backward keeps, fp32: every layer's activations (`debug memory`'s model: ~10h + 4 kv +
    # 5 ffn values a token) against one input per layer plus one layer's recomputed set
    per_layer = ROWS * T * (14 * HIDDEN + 5 * FFN) * 4
    assert peak_off > 0.6 * LAYERS * per_layer, (peak_off, per_layer)
    assert peak_on < 1.5 * (LAYERS * ROWS * T * HIDDEN * 4 + per_layer), (peak_on, peak_off, per_layer)
    assert peak_on < 0.35 * peak_off, (peak_on / 2**20, peak_off / 2**20)


def test_the_critic_backbone_checkpoints_in_eval_mode(deep_model_dir):
    critic = load_value_model(deep_model_dir, grad_checkpointing=True)
    assert checkpointed_layers(critic) == LAYERS
    assert checkpointed_layers(load_value_model(deep_model_dir)) == 0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_debug_memorys_measured_activations_agree_with_its_estimate(deep_model_dir, checkpointing):
    """What `debug memory` measures of an update (autograd's saved tensors, and with checkpointing each
    layer's kept input) against what its model estimates for the same rows: the estimate bounds it from
    above (token budgets and the start-up refusal rest on it), and not by more than 1/0.6."""
    from verl_ds.diagnostics.memory import ModelShape
    from verl_ds.diagnostics.memory.estimate import pass_memory
    from verl_ds.diagnostics.memory.measure import MemoryTimer

    model = load_causal_lm(deep_model_dir, grad_checkpointing=checkpointing)
    actor = Actor(model, ds_config("actor", 0, "fp32", micro=ROWS, total=ROWS), Cfg())
    batch = long_batch(model.config.vocab_size, t=1024)
    timer = MemoryTimer({"actor": actor}, track_activations=True)
    with timer("update_actor", stage="update", role="actor"):
        actor.accumulate(batch, float(batch.loss_mask.sum()), float(ROWS))
        actor.step()
    measured = timer.memory_metrics()["memory/update/actor/activations_mib"] * 2**20
    shape = ModelShape.from_hf_config(model.config.to_dict())
    est = pass_memory(shape, "fp32", ROWS, 1024, R, head="lm", grad=True, grad_checkpointing=checkpointing)
    assert 0.6 < measured / est["activations"] <= 1.0, (measured, est)
