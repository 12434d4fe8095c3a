"""`roles.<role>.sleep` on real DeepSpeed engines: the states go to host memory and come back bitwise,
and training goes on as if the role had never slept. On CPU `sleep(force=True)` runs the same
DeepSpeed calls and checks (ZeRO-3's optimizer assertion included) as a host-to-host move."""

import pytest
import torch

from tests.roles.helpers import Cfg, ds_config, make_batch, update
from verl_ds.roles import Actor, iter_full_params, load_causal_lm
from verl_ds.roles import ds_internals as dsi


def states(role) -> dict[str, torch.Tensor]:
    """Every state a sleep moves, copied: full weights, masters, optimizer states, by name."""
    out = {f"param/{n}": t.clone() for n, t in iter_full_params(role.engine)}
    out.update({f"master/{i}": t.clone() for i, t in enumerate(role.master_params())})
    opt = dsi.torch_optimizer(role.engine.optimizer)
    for i, s in enumerate(opt.state.values()):
        out.update({f"optim/{i}/{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    return out


def own_moves(role) -> list[torch.Tensor]:
    """What verl-ds moves itself at ZeRO-3 (DeepSpeed asserts its FusedAdam for these): the masters
    and the torch optimizer's states."""
    opt = dsi.torch_optimizer(role.engine.optimizer)
    return role.master_params() + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


# fp16 (emulated on CPU, slow) at ZeRO-3 only, where verl-ds moves states itself
@pytest.mark.parametrize("stage,dtype", [(s, d) for s in (1, 2, 3) for d in ("fp32", "bf16")] + [(3, "fp16")])
def test_a_role_asleep_comes_back_bitwise_and_trains_as_one_that_never_slept(tiny_model_dir, stage, dtype):
    awake = Actor(load_causal_lm(tiny_model_dir), ds_config("actor", stage, dtype), Cfg())
    slept = Actor(load_causal_lm(tiny_model_dir), ds_config("actor", stage, dtype), Cfg())
    batch = make_batch(awake.module.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    lp = awake.logprobs(batch)
    batch = batch.replace(old_logprobs=lp, advantages=torch.randn(lp.shape, generator=g))
    counts = float(batch.loss_mask.sum()), float(len(batch))
    assert not slept.sleep(), "on CPU only a forced sleep moves anything"
    for step in range(3):  # the first step creates the optimizer states the sleep then moves
        if step == 1:
            before = states(slept)
            # the storages before the sleep, kept alive: the sleep frees them (`.data` swapped), and on CPU
            # a freed address is soon handed out again, to a host copy of the same size
            kept = [t.detach() for t in own_moves(slept)]
            assert slept.sleep(force=True) and slept.asleep
            assert not slept.sleep(force=True), "asleep already"
            if stage == 3:  # the masters and Adam states left their storage for host copies
                host = [t.detach() for t in own_moves(slept)]  # the host copies' storage, kept apart
                assert not storages(host) & storages(kept)
            slept.wake()
            assert not slept.asleep
            if stage == 3:  # and came back out of the host copies (a fresh tensor, on CPU too)
                assert not storages(own_moves(slept)) & storages(host)
            after = states(slept)
            assert before.keys() == after.keys()
            for k, v in before.items():
                assert torch.equal(v, after[k]), k
        losses = [update(role, batch, *counts)["pg_loss"] for role in (awake, slept)]
        assert losses[0] == losses[1], (step, losses)
    want = dict(iter_full_params(awake.engine))
    for n, t in iter_full_params(slept.engine):
        assert torch.equal(t, want[n]), n
