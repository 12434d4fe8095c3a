"""`roles.<role>.tiled_mlp` (DeepSpeed's TiledMLP on every decoder MLP, `roles/long_rows.py`): the MLPs run in
tiles of `hidden` tokens, and the actor's logprobs and gradients are the untiled ones (summation order)."""

import pytest
import torch

from tests.roles.helpers import Cfg, accumulated_grads, assert_same_gradients, ds_config, make_batch
from verl_ds.roles import Actor, load_causal_lm
from verl_ds.roles.long_rows import tile_mlps


@pytest.mark.numerics
@pytest.mark.parametrize("stage", [0, 3])
def test_tiled_mlps_give_the_untiled_logprobs_and_gradients_one_tile_at_a_time(tiny_model_dir, stage):
    torch.manual_seed(0)
    cfg = ds_config("actor", stage, "fp32", micro=2, total=2)
    plain, tiled = (Actor(load_causal_lm(tiny_model_dir), cfg, Cfg()) for _ in range(2))
    assert tile_mlps(tiled.module) == tiled.module.config.num_hidden_layers
    hidden = tiled.module.config.hidden_size
    batch = make_batch(plain.module.config.vocab_size, b=2, p=5 * hidden - 7, r=9)  # 5 tiles a row
    seen = []  # the tokens each MLP activation runs on at once
    for layer in tiled.module.model.layers:
        layer.mlp.act_fn.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[-2]))
    lp = plain.logprobs(batch)
    torch.testing.assert_close(tiled.logprobs(batch), lp, rtol=0, atol=1e-5)
    assert seen and max(seen) <= hidden, seen  # never the whole row
    batch = batch.replace(old_logprobs=lp, advantages=torch.randn_like(lp))
    assert_same_gradients(accumulated_grads(tiled, batch), accumulated_grads(plain, batch))


def test_a_model_without_a_gated_mlp_is_refused_by_name():
    with pytest.raises(ValueError, match="tiled_mlp found no gated MLP"):
        tile_mlps(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.numerics
def test_offloaded_checkpoint_inputs_give_the_same_gradients(tiny_model_dir):
    """`offload_activations` (a GPU's memory; on CPU the builder leaves it off): forced on here, DeepSpeed's
    offload marks each checkpointed layer's input for the host at its forward, and the gradients are the
    plain run's. On CPU DeepSpeed then keeps every marked input where it is (its CPU accelerator is the
    host): the wiring runs here, the copy to the host only on a GPU."""
    torch.manual_seed(0)
    cfg = ds_config("actor", 0, "fp32", micro=2, total=2)
    plain, offloaded = (Actor(load_causal_lm(tiny_model_dir, grad_checkpointing=True), cfg, Cfg()) for _ in range(2))
    offloaded.offload_activations = True
    batch = make_batch(plain.module.config.vocab_size, b=2, p=40, r=9)
    lp = plain.logprobs(batch)
    batch = batch.replace(old_logprobs=lp, advantages=torch.randn_like(lp))
    assert_same_gradients(accumulated_grads(offloaded, batch), accumulated_grads(plain, batch))
    stats = offloaded.activation_offload_stats
    layers = offloaded.module.config.num_hidden_layers
    assert stats.marked_tensors == layers, stats  # every checkpointed layer's input, and nothing else
    assert stats.skipped_marked_tensors == layers and stats.offloaded_tensors == 0, stats  # CPU: stays
