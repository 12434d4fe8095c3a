"""Run by test_sequence_parallel.py under `deepspeed --num_gpus 2` (CPU, gloo): each row split over 2 ranks
by DeepSpeed's Ulysses SP gives what the unsplit pass gives on the same rows: a frozen policy's logprobs
and entropy, the actor's gradients at ZeRO 0-3 (and with LoRA), the critic's values and gradients, a reward
model's scores (at ZeRO-3: its backbone and head called apart).

The unsplit passes run first: registering SP replaces the process's sdpa attention for every model.
`SP_PLANTS=1` plants each bug the checks must catch in turn (`PLANTS`: the loss scaled by the world, as
without SP; each shard's last label dropped) and prints which check caught it."""

import atexit
import os
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist

from tests.roles.helpers import Cfg, assert_same_gradients, ds_config, make_group_batch
from verl_ds.dist import init_distributed, world_size
from verl_ds.roles import Actor, Critic, Reference, RewardModel, load_causal_lm, load_reward_model, load_value_model
from verl_ds.roles import ds_internals as dsi
from verl_ds.roles.sequence_parallel import SequenceParallel

STAGES = (0, 1, 2, 3)
VOCAB = 20  # the tiny model's (conftest `tiny_model_dir`)


def rows():
    """Rows of unequal length (left-padded prompts, right-padded responses), lengths SP 2 does not
    divide, and shard boundaries inside responses (where a dropped boundary token shows)."""
    batch = make_group_batch(VOCAB, prompt_lens=(2, 5, 3), resp_lens=(9, 6, 3, 8), seed=7)
    lengths = batch.attention_mask.sum(1).tolist()
    assert any(n % 2 for n in lengths) and len(set(lengths)) > 3, lengths
    plens = (batch.attention_mask[:, : -batch.response_width].sum(1)).tolist()
    assert any(-(-n // 2) > p for n, p in zip(lengths, plens)), "no shard boundary inside a response"
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask
    return batch.replace(advantages=adv, returns=torch.randn(batch.loss_mask.shape, generator=g))


def config(role: str, stage: int, dp: int, n: int) -> dict:
    """One row per micro-batch (SP's), `n` rows a step on each of `dp` data-parallel ranks."""
    ds = ds_config(role, stage, "fp32", micro=1, total=n)
    ds["train_batch_size"], ds["gradient_accumulation_steps"] = n * dp, n
    ds["zero_optimization"]["stage"] = stage
    return ds


def grads(role, batch, replicas: int) -> dict:
    """One mini-batch's reduced gradient per parameter (`safe_get_full_grad`: collective at ZeRO-3). The
    rows sit on `replicas` data-parallel ranks, so the global counts are that many times the batch's."""
    from deepspeed.utils import safe_get_full_grad

    role.accumulate(batch, float(batch.loss_mask.sum()) * replicas, float(len(batch)) * replicas)
    trained = [(n, p) for n, p in role.module.named_parameters() if p.requires_grad]
    out = {n: safe_get_full_grad(p).detach().float().clone() for n, p in trained}
    return out


def actor(model_dir: str, stage: int, dp: int, n: int, sp=None, lora: bool = False, checkpointed: bool = False):
    model = load_causal_lm(model_dir, attn_implementation="sdpa")
    if checkpointed:
        from verl_ds.roles.base import enable_grad_checkpointing

        enable_grad_checkpointing(model)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # the same adapters in both runs; random B too, else A gets no gradient
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        model = get_peft_model(model, cfg)
    return Actor(model, config("actor", stage, dp, n), Cfg(entropy_coef=0.01), sp=sp)


def value_model(model_dir: str):
    """The critic with a seeded nonzero head (the zero head would hide the backbone's gradients)."""
    model = load_value_model(model_dir)
    torch.nn.init.normal_(model.v_head.weight, std=0.1, generator=torch.Generator().manual_seed(0))
    return model


def reward_model(model_dir: str, dp: int, n: int, sp=None) -> RewardModel:
    """The tiny model as a scorer, its head seeded alike in both runs."""
    torch.manual_seed(0)
    return RewardModel(load_reward_model(model_dir, attn_implementation="sdpa"), config("reward", 3, dp, n), sp=sp)


@contextmanager
def planted_divisor():
    """The loss scaled by the world, as without SP: gradients SP times too large at ZeRO-1/2."""
    real = dsi.gradient_divisor
    dsi.gradient_divisor = lambda engine: float(engine.world_size)
    try:
        yield
    finally:
        dsi.gradient_divisor = real


@contextmanager
def planted_boundary():
    """Each shard's last label dropped (a shard-local `logits[:, :-1]`)."""
    shard = SequenceParallel.shard
    SequenceParallel.shard = lambda self, ids: (lambda a, p, y: (a, p, torch.cat([y[:-1], y[-1:] * 0])))(
        *shard(self, ids)
    )
    try:
        yield
    finally:
        SequenceParallel.shard = shard


@contextmanager
def planted_pack_mask():
    """A pack's rows attending causally over the whole pack (its rule `k <= q < end[k]` dropped past the
    all-to-all): each row sees its siblings' tokens."""
    from verl_ds.roles import sequence_parallel

    real = sequence_parallel.prefix.allowed
    sequence_parallel.prefix.allowed = lambda end: torch.ones(len(end), len(end), dtype=torch.bool).tril()
    try:
        yield
    finally:
        sequence_parallel.prefix.allowed = real


@contextmanager
def planted_pack_reset():
    """The pack's rule cleared once its forward returns: a checkpointed layer recomputed in the backward
    would attend causally over the whole pack (the forward's values stay right)."""
    from verl_ds.roles import sequence_parallel

    real = sequence_parallel.SequenceParallel.policy_forward

    def forward(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        sequence_parallel._PACK_RULE.set(None)
        return out

    sequence_parallel.SequenceParallel.policy_forward = forward
    try:
        yield
    finally:
        sequence_parallel.SequenceParallel.policy_forward = real


PLANTS = {
    "divisor": planted_divisor,
    "boundary": planted_boundary,
    "pack mask": planted_pack_mask,
    "pack reset": planted_pack_reset,
}


def shared(role):
    """`role` as a run with shared prefixes under SP builds it: a micro-batch is a pack of rows (a token
    budget over the whole batch here: one pack of its three prompts' twelve rows)."""
    role.share_prefixes, role.share_min_tokens, role.max_tokens = True, 0, 10_000
    return role


def main(model_dir: str, plants: bool) -> None:
    init_distributed()
    world = world_size()
    batch = rows()
    n = len(batch)
    zeros = torch.zeros(batch.loss_mask.shape)
    batch = batch.replace(old_logprobs=zeros, old_values=zeros)
    mask = batch.loss_mask.bool()
    stages = (1,) if plants else STAGES  # a planted bug need only fail the check that should catch it

    # ---- unsplit: every rank runs every row (the world's data-parallel ranks hold the same rows)
    ref = Reference(load_causal_lm(model_dir, attn_implementation="sdpa"), config("reference", 3, world, n))
    want_lp, want_ent = ref.logprobs(batch, with_entropy=True)
    want_grads = {s: grads(actor(model_dir, s, world, n), batch, world) for s in stages}
    if not plants:
        want_lora = grads(actor(model_dir, 2, world, n, lora=True), batch, world)
        critic = Critic(value_model(model_dir), config("critic", 2, world, n), Cfg())
        want_values = critic.values(batch)
        want_critic = grads(critic, batch, world)
        want_scores = reward_model(model_dir, world, n).score(batch)

    # ---- split: SP 2, one data-parallel group
    sp = SequenceParallel.register(model_dir, 2)
    assert (sp.size, world) == (2, 2)
    dp = world // sp.size

    def check_policy() -> None:
        for how, wrap in (("", lambda role: role), ("shared ", shared)):
            ref = Reference(load_causal_lm(model_dir, attn_implementation="sdpa"), config("reference", 3, dp, n), sp=sp)
            got_lp, got_ent = wrap(ref).logprobs(batch, with_entropy=True)
            held, distinct, _ = ref.take_token_counts()["score"]
            assert (distinct < held) == bool(how), (how, held, distinct)  # the prompts ran once, or not
            for what, got, want in (("logprobs", got_lp, want_lp), ("entropy", got_ent, want_ent)):
                diff = float((got - want)[mask].abs().max())
                assert diff <= 1e-5, f"SP 2 {how}{what} differ from SP 1 by {diff:.3g}"
                assert torch.all(got[~mask] == 0), what
            for s in stages:
                got = grads(wrap(actor(model_dir, s, dp, n, sp=sp)), batch, dp)
                try:
                    assert_same_gradients(got, want_grads[s])
                except AssertionError as e:
                    raise AssertionError(f"ZeRO-{s} {how}actor gradients: {e}") from None
        # gradient checkpointing recomputes each layer in the backward: under the pack's rule still
        try:
            assert_same_gradients(
                grads(shared(actor(model_dir, 1, dp, n, sp=sp, checkpointed=True)), batch, dp), want_grads[1]
            )
        except AssertionError as e:
            raise AssertionError(f"ZeRO-1 shared checkpointed actor gradients: {e}") from None

    if plants:  # each planted bug alone, against the same checks: the first it fails is named
        for name, plant in PLANTS.items():
            with plant():
                try:
                    check_policy()
                except AssertionError as e:
                    print(f"CAUGHT {name}: {str(e).splitlines()[0]}", flush=True)
                except torch.utils.checkpoint.CheckpointError as e:  # torch's own check of the recompute
                    print(f"CAUGHT {name}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
                else:
                    print(f"MISSED {name}", flush=True)
        return
    check_policy()
    for wrap in (lambda role: role, shared):  # LoRA: the adapters' gradients, split and shared alike
        assert_same_gradients(grads(wrap(actor(model_dir, 2, dp, n, sp=sp, lora=True)), batch, dp), want_lora)
    for how, wrap in (("", lambda role: role), ("shared ", shared)):
        critic = wrap(Critic(value_model(model_dir), config("critic", 2, dp, n), Cfg(), sp=sp))
        got_values = critic.values(batch)
        diff = float((got_values - want_values)[mask].abs().max())
        assert diff <= 1e-5, f"SP 2 {how}critic values differ from SP 1 by {diff:.3g}"
        assert_same_gradients(grads(critic, batch, dp), want_critic)
    # each rank scores its own rows, before a group joins them: unequal counts, some rows on both
    own = torch.arange(0, 3) if sp.rank == 0 else torch.arange(2, n)
    got_scores = reward_model(model_dir, dp, n, sp=sp).score(batch.select(own))
    diff = float((got_scores - want_scores[own]).abs().max())
    assert diff <= 1e-5, f"SP 2 reward scores differ from SP 1 by {diff:.3g}"
    print(f"SP_OK rows={n} tokens={int(mask.sum())} stages={STAGES}", flush=True)


if __name__ == "__main__":
    main(sys.argv[-1], plants=os.environ.get("SP_PLANTS") == "1")
    # as the CLI ends a rank (two_rank_script.py): exit handlers, then no interpreter teardown, where a
    # rank aborted in CI ("terminate called without an active exception", exit -6) after both had passed
    dist.barrier()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    os._exit(0)
