"""Every role is a real DeepSpeed engine with its own precision (single process, gloo, CPU)."""

import math

import pytest
import torch

from tests.roles.helpers import (
    Cfg,
    accumulated_grads,
    assert_same_gradients,
    ds_config,
    make_batch,
    make_group_batch,
    update,
)
from verl_ds.roles import (
    Actor,
    Critic,
    Reference,
    RewardModel,
    align_overflow,
    iter_full_params,
    load_causal_lm,
    load_reward_model,
    load_value_model,
    policy,
)
from verl_ds.roles.base import pack_by_tokens
from verl_ds.roles.batch import TrainBatch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def ppo_batch(actor, batch):
    lp = actor.logprobs(batch)
    return batch.replace(
        old_logprobs=lp, advantages=torch.randn_like(lp), returns=torch.randn_like(lp), old_values=torch.zeros_like(lp)
    )


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_trained_roles_forward_and_step(tiny_model_dir, stage, dtype):
    actor = Actor(load_causal_lm(tiny_model_dir), ds_config("actor", stage, dtype), Cfg())
    critic = Critic(load_value_model(tiny_model_dir), ds_config("critic", stage, dtype), Cfg())
    batch = ppo_batch(actor, make_batch(actor.module.config.vocab_size))
    assert next(actor.module.parameters()).dtype == DTYPES[dtype]
    before = {n: t.float().clone() for n, t in iter_full_params(actor.engine)}
    m = update(actor, batch, global_tokens=float(batch.loss_mask.sum()), global_seqs=4.0)
    v = update(critic, batch, global_tokens=float(batch.loss_mask.sum()), global_seqs=4.0)
    assert math.isfinite(m["pg_loss"]) and math.isfinite(v["vf_loss"])
    after = dict(iter_full_params(actor.engine))
    assert any(not torch.equal(before[n], after[n].float()) for n in before), "actor did not step"
    inner = actor.engine.optimizer  # DeepSpeed's wrappers hold the torch optimizer
    while not isinstance(inner, torch.optim.Optimizer):
        inner = inner.optimizer
    assert isinstance(inner, torch.optim.AdamW) and inner.defaults["fused"]  # one kernel, not a loop
    stats = actor.precision_stats()
    assert stats["param_dtype"] == str(DTYPES[dtype]).split(".")[1]
    if dtype != "fp32":  # DeepSpeed keeps fp32 master weights for 16-bit compute
        assert stats["master_dtype"] == "float32"
    assert stats["skipped_steps"] == 0
    # every stage and dtype reports the update's gradient norm (fp32 ZeRO-0: DeepSpeed keeps none)
    assert math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_frozen_roles_forward(tiny_model_dir, stage, dtype):
    ref = Reference(load_causal_lm(tiny_model_dir), ds_config("reference", stage, dtype))
    batch = make_batch(ref.module.config.vocab_size)
    lp = ref.logprobs(batch)
    assert lp.dtype == torch.float32 and lp.shape == (4, 3) and torch.isfinite(lp).all()
    rm = RewardModel(load_reward_model(tiny_model_dir), ds_config("reward", stage, dtype))
    assert torch.isfinite(rm.score(batch)).all()


def test_bf16_master_weights_are_fp32(tiny_model_dir):
    actor = Actor(load_causal_lm(tiny_model_dir), ds_config("actor", 2, "bf16"), Cfg())
    assert all(p.dtype == torch.float32 for p in actor.master_params())
    assert next(actor.module.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_overflow_skips_both_roles_and_follows_hysteresis(tiny_model_dir, stage):
    actor = Actor(load_causal_lm(tiny_model_dir), ds_config("actor", stage, "fp16", hysteresis=2), Cfg())
    critic = Critic(load_value_model(tiny_model_dir), ds_config("critic", stage, "fp16", hysteresis=2), Cfg())
    batch = ppo_batch(actor, make_batch(actor.module.config.vocab_size))
    n_tok = float(batch.loss_mask.sum())
    scales = []
    clean = actor.micro_loss

    def overflowing(mb, counts):  # loss x inf: a real fp16 overflow in the actor only
        loss, metrics, out = clean(mb, counts)
        return loss * float("inf"), metrics, out

    for _ in range(2):
        a0 = {n: t.clone() for n, t in iter_full_params(actor.engine)}
        c0 = {n: t.clone() for n, t in iter_full_params(critic.engine)}
        actor.micro_loss = overflowing
        actor.accumulate(batch, n_tok, 4.0)
        critic.accumulate(batch, n_tok, 4.0)
        assert align_overflow(actor, critic)
        actor.step()
        critic.step()
        scales.append(actor.precision_stats()["loss_scale"])
        for n, t in iter_full_params(actor.engine):
            assert torch.equal(t, a0[n]), f"actor param {n} changed on an overflow step"
        for n, t in iter_full_params(critic.engine):
            assert torch.equal(t, c0[n]), f"critic param {n} changed on the aligned skip"
    assert scales == [2048.0, 1024.0]  # hysteresis 2: first overflow keeps the scale
    a, c = actor.precision_stats(), critic.precision_stats()
    assert a["skipped_steps"] == 2 and a["overflow"] == 1.0
    assert c["skipped_steps"] == 2 and c["aligned_skips"] == 2
    actor.micro_loss = clean  # a clean step applies again
    actor.accumulate(batch, n_tok, 4.0)
    critic.accumulate(batch, n_tok, 4.0)
    assert not align_overflow(actor, critic)
    actor.step()
    assert actor.precision_stats()["skipped_steps"] == 2


@pytest.mark.numerics
@pytest.mark.parametrize("stage", [0, 3])
def test_iter_full_params_equals_hf_state_dict(tiny_model_dir, stage):
    hf = load_causal_lm(tiny_model_dir)
    sd = hf.state_dict()
    ref = Reference(load_causal_lm(tiny_model_dir), ds_config("reference", stage, "fp32"))
    got = dict(iter_full_params(ref.engine))
    assert set(got) == {n for n, _ in hf.named_parameters()}  # plain HF names, tied weight once
    for n, t in got.items():
        assert torch.equal(t, sd[n]), n


@pytest.fixture(scope="module")
def reward_dir(tiny_model_dir, tmp_path_factory):
    """A saved sequence classifier (its score head would otherwise be re-initialised on every load)."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    torch.nn.init.normal_(rm.score.weight, std=0.5)
    out = tmp_path_factory.mktemp("rm")
    rm.save_pretrained(out)
    return str(out)


@pytest.mark.numerics
@pytest.mark.parametrize("activation", ["fp32", "bf16"])
def test_int8_reward_close_to_fp32_smaller_and_really_int8(reward_dir, monkeypatch, activation):
    """An int8 reward model built as a run builds it: `deepspeed.initialize`, which moves every weight
    to the device and broadcasts it viewed as uint8 bytes (gloo, on CPU too), then torchao's int8
    weight-only Linear (quantized first, the engine fails at the move); scored after a ZeRO-3 role
    has rebound `torch.nn.functional.linear` for the whole process, as a run's actor does. Scores
    close to fp32; every Linear weight stored as int8 with a scale and zero point per output row,
    and the reported bytes are those of that storage."""
    import deepspeed.comm

    from verl_ds.roles.ds_internals import storage_tensors
    from verl_ds.roles.quant import Int8Linear

    Reference(load_causal_lm(reward_dir), ds_config("reference", 3, "fp32"))
    assert torch.nn.functional.linear is not torch._C._nn.linear  # DeepSpeed's ZeRO-3 linear, from now on
    batch = make_batch(20)
    fp32 = RewardModel(load_reward_model(reward_dir), ds_config("reward", 0, "fp32"))
    broadcast, real = [], deepspeed.comm.broadcast
    monkeypatch.setattr(deepspeed.comm, "broadcast", lambda t, *a, **k: broadcast.append(t) or real(t, *a, **k))
    int8 = RewardModel(load_reward_model(reward_dir), ds_config("reward", 0, "fp32"), int8_activation=activation)
    assert len(broadcast) == len(list(fp32.module.parameters()))  # the engine's real broadcast ran, on every weight
    s32, s8 = fp32.score(batch), int8.score(batch)
    err = (s32 - s8).abs().max().item()
    print(f"int8 ({activation} activations) vs fp32 reward max |diff| = {err:.4g} (scores std {s32.std():.4g})")
    assert err <= 0.10 * s32.abs().max().item()  # stated tolerance: 10% of the score scale
    linears = [m for m in int8.module.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == sum(type(m) is torch.nn.Linear for m in fp32.module.modules()) and all(
        [(t.dtype, t.shape) for t in storage_tensors(m.weight)]
        == [(torch.int8, m.weight.shape), (torch.float32, (m.weight.shape[0], 1)), (torch.int8, (m.weight.shape[0], 1))]
        for m in linears
    )
    assert int8.precision_stats()["param_dtype"] == "int8"
    b32, b8 = fp32.precision_stats()["weight_bytes"], int8.precision_stats()["weight_bytes"]
    print(f"reward weights fp32 {b32 / 1024:.1f} KiB -> int8 {b8 / 1024:.1f} KiB")
    # by storage: the model in its activation dtype, then each Linear weight at 1 byte an element plus
    # a 4-byte scale and a 1-byte zero point a row
    size = DTYPES[activation].itemsize
    tensors = [*fp32.module.parameters(), *fp32.module.buffers()]
    cast = sum(t.numel() * (size if t.is_floating_point() else t.element_size()) for t in tensors)
    assert b8 == cast - sum((size - 1) * m.weight.numel() - 5 * m.weight.shape[0] for m in linears)
    assert b8 < 0.5 * b32


def test_grad_checkpointing_trains(tiny_model_dir):
    actor = Actor(load_causal_lm(tiny_model_dir, grad_checkpointing=True), ds_config("actor", 3, "fp32"), Cfg())
    assert actor.module.is_gradient_checkpointing
    batch = ppo_batch(actor, make_batch(actor.module.config.vocab_size))
    m = update(actor, batch, float(batch.loss_mask.sum()), 4.0)
    assert math.isfinite(m["pg_loss"])


def test_checkpoint_roundtrip(tiny_model_dir, tmp_path):
    actor = Actor(load_causal_lm(tiny_model_dir), ds_config("actor", 3, "fp32"), Cfg())
    batch = ppo_batch(actor, make_batch(actor.module.config.vocab_size))
    update(actor, batch, float(batch.loss_mask.sum()), 4.0)
    actor.save(str(tmp_path), "step1")
    want = dict(iter_full_params(actor.engine))
    other = Actor(load_causal_lm(tiny_model_dir), ds_config("actor", 3, "fp32"), Cfg())
    other.load(str(tmp_path), "step1")
    for n, t in iter_full_params(other.engine):
        assert torch.equal(t, want[n]), n


def test_frozen_head_does_not_expand_its_weight_per_sequence(tiny_model_dir):
    """With `logits_to_keep`, a frozen LM head gets a strided slice; without the contiguity hook
    torch.matmul expands the [V, H] weight per sequence (a bmm over B weight copies)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from verl_ds.roles.policy import load_causal_lm

    ids = torch.randint(3, 10, (4, 12))

    def bmm_calls(model) -> int:
        model.requires_grad_(False)
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            model(input_ids=ids, use_cache=False, logits_to_keep=5)
        return sum(e.count for e in prof.key_averages() if e.key == "aten::bmm")

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert bmm_calls(plain) > 0  # the slow path exists (or this test proves nothing)
    assert bmm_calls(load_causal_lm(tiny_model_dir)) == 0


@pytest.mark.numerics
@pytest.mark.parametrize("stage", [0, 3])
def test_token_budget_micro_batches_give_the_same_gradient(tiny_model_dir, stage):
    """max_tokens_per_micro_batch: 8 rows x 8 tokens under a 16-token budget run as 4 micro-batches
    of 2 rows (the config says 4 rows, gas 2), and the accumulated gradient equals the row-sized
    path's. Gradients, not weights after Adam: Adam's first step is ~lr * sign(g), so a rounding
    difference in a near-zero gradient element becomes a visible weight difference."""
    torch.manual_seed(0)
    cfg = ds_config("actor", stage, "fp32", micro=4, total=8)
    actors = [Actor(load_causal_lm(tiny_model_dir), cfg, Cfg()) for _ in range(2)]
    actors[1].max_tokens = 16
    batch = ppo_batch(actors[0], make_batch(actors[0].module.config.vocab_size, b=8))
    calls = []
    actors[1].module.register_forward_hook(lambda *_: calls.append(1))
    torch.testing.assert_close(actors[1].logprobs(batch), batch.old_logprobs, rtol=0, atol=1e-5)
    assert len(calls) == 4
    grads = [accumulated_grads(a, batch) for a in actors]
    assert len(calls) == 8 and actors[1].engine.global_steps == actors[0].engine.global_steps == 1
    assert_same_gradients(grads[1], grads[0])


@pytest.mark.numerics
def test_padding_removal_runs_each_micro_batch_on_the_columns_it_uses(tiny_model_dir):
    """Rows come padded to the batch's longest prompt and response (here with 3 extra pad columns on
    the left and 2 on the right): each micro-batch runs only the columns its own rows use, and the
    logprobs and values equal each row's own unpadded forward."""
    torch.manual_seed(0)
    ref = Reference(load_causal_lm(tiny_model_dir), ds_config("reference", 0, "fp32", micro=2))
    critic = Critic(load_value_model(tiny_model_dir), ds_config("critic", 0, "fp32", micro=2), Cfg())
    vocab = ref.module.config.vocab_size
    lens = [(3, 1), (2, 1), (5, 3), (4, 2)]  # (prompt, response) per row: micro-batch 0 is short
    rows = [(torch.randint(3, vocab, (p,)), torch.randint(3, vocab, (r,))) for p, r in lens]
    P, R = 5 + 3, 3 + 2
    ids, attn = torch.zeros(4, P + R, dtype=torch.long), torch.zeros(4, P + R, dtype=torch.long)
    resp = torch.zeros(4, R)
    for i, (p, r) in enumerate(rows):
        ids[i, P - len(p) : P], ids[i, P : P + len(r)] = p, r
        attn[i, P - len(p) : P + len(r)] = 1
        resp[i, : len(r)] = 1
    batch = TrainBatch(ids, attn, resp)
    widths = []
    hooks = [
        role.module.register_forward_pre_hook(
            lambda _m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True
        )
        for role in (ref, critic)
    ]
    lp, values = ref.logprobs(batch), critic.values(batch)
    for h in hooks:
        h.remove()
    assert widths == [3 + 1, 5 + 3] * 2  # per micro-batch (reference, then critic), not 13 columns
    assert lp.shape == values.shape == (4, R)
    for out in (lp, values):  # columns a micro-batch did not run come back as zeros (masked)
        assert (out[:2, 1:] == 0).all() and (out[2:, 3:] == 0).all()
    with torch.no_grad():
        for i, (p, r) in enumerate(rows):
            seq = torch.cat([p, r])[None]
            logits = ref.module(input_ids=seq).logits[0, len(p) - 1 : -1].float()
            want = torch.log_softmax(logits, -1).gather(-1, r[:, None])[:, 0]
            torch.testing.assert_close(lp[i, : len(r)], want, rtol=0, atol=1e-5)
            v = critic.module(seq, torch.ones_like(seq), torch.arange(seq.shape[1])[None])[0]
            torch.testing.assert_close(values[i, : len(r)], v[len(p) - 1 : -1].float(), rtol=0, atol=1e-5)


def _padded_rows(vocab: int, lens: list[tuple[int, int]], P: int, R: int) -> dict:
    """Rows of (prompt, response) lengths `lens`, left-padded to P prompt and right-padded to R
    response columns, as the rollout hands them over."""
    n = len(lens)
    ids, attn = torch.zeros(n, P + R, dtype=torch.long), torch.zeros(n, P + R, dtype=torch.long)
    resp = torch.zeros(n, R)
    for i, (p, r) in enumerate(lens):
        ids[i, P - p : P + r] = torch.randint(3, vocab, (p + r,))
        attn[i, P - p : P + r] = 1
        resp[i, :r] = 1
    return TrainBatch(ids, attn, resp)


@pytest.mark.numerics
def test_a_token_budget_runs_a_long_tail_without_padding_and_counts_what_ran(tiny_model_dir):
    """8 rows with one long response in each 4-row micro-batch: row micro-batches pad three short rows
    to it (real 68 of 128 tokens); the `auto` budget (micro 4 x the longest row, 16) packs the short
    rows together and the long ones together (68 of 68). `take_token_counts` reports exactly what
    the forwards ran, per pass, and the logprobs are the row path's."""
    torch.manual_seed(0)
    ref = Reference(load_causal_lm(tiny_model_dir), ds_config("reference", 0, "fp32", micro=4))
    lens = [(4, 2)] * 3 + [(4, 12)] + [(4, 2)] * 3 + [(4, 12)]
    batch = _padded_rows(ref.module.config.vocab_size, lens, P=4, R=12)
    widths = []
    ref.module.register_forward_pre_hook(lambda _m, a, kw: widths.append(kw["input_ids"].shape), with_kwargs=True)
    rows_lp = ref.logprobs(batch)
    assert ref.take_token_counts() == {"score": (68.0, 68.0, 128.0), "update": (0.0, 0.0, 0.0)}
    assert ref.take_token_counts() == {"score": (0.0, 0.0, 0.0), "update": (0.0, 0.0, 0.0)}  # taken: zeroed
    ref.max_tokens = 4 * 16
    packed_lp = ref.logprobs(batch)
    assert ref.take_token_counts()["score"] == (68.0, 68.0, 68.0)
    assert [tuple(w) for w in widths] == [(4, 16), (4, 16), (6, 6), (2, 16)]
    mask = batch.loss_mask.bool()  # past a row's end both paths run padding: not compared
    torch.testing.assert_close(packed_lp[mask], rows_lp[mask], rtol=0, atol=1e-5)


@pytest.mark.numerics
def test_the_reward_model_runs_only_the_columns_its_rows_use(reward_dir):
    """A token budget counts a micro-batch's used columns, so the reward model's forward runs only
    those (as the policy's and the critic's do): its scores equal each row scored alone."""
    torch.manual_seed(0)
    rm = RewardModel(load_reward_model(reward_dir), ds_config("reward", 0, "fp32", micro=2))
    lens = [(3, 1), (2, 2), (5, 3), (4, 2)]
    batch = _padded_rows(rm.module.config.vocab_size, lens, P=8, R=5)
    widths = []
    rm.module.register_forward_pre_hook(lambda _m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    scores = rm.score(batch)
    assert widths[:2] == [3 + 2, 5 + 3]
    P = 8
    with torch.no_grad():
        for i, (p, r) in enumerate(lens):
            seq = batch.input_ids[i, P - p : P + r][None]
            alone = rm.module(input_ids=seq, attention_mask=torch.ones_like(seq)).logits[0, 0].float()
            torch.testing.assert_close(scores[i], alone, rtol=0, atol=1e-5)


def _packed_batch(vocab: int) -> TrainBatch:
    """GRPO rows of 3 prompts (2-5 tokens, left-padded) x 4 responses (1-3 tokens), one response empty."""
    batch = make_group_batch(vocab)
    mask, loss = batch.attention_mask.clone(), batch.loss_mask.clone()
    mask[5, -loss.shape[1] :], loss[5] = 0, 0
    return batch.replace(attention_mask=mask, loss_mask=loss)


@pytest.mark.numerics
@pytest.mark.parametrize("stage", [0, 3])
def test_packed_rows_score_and_train_as_padded_rows(tiny_model_dir, stage):
    """`model.packing`: a micro-batch's rows run as one sequence of their real tokens (positions
    restarting per row) under a 20-token budget: the logprobs and entropies of every response token
    and the accumulated gradient equal the padded rows' (fp32), nothing but real tokens runs, and
    the rows come back in their order."""
    torch.manual_seed(0)
    cfg = ds_config("actor", stage, "fp32", micro=12, total=12)
    actors = [Actor(load_causal_lm(tiny_model_dir), cfg, Cfg()) for _ in range(2)]
    actors[1].packing, actors[1].max_tokens = True, 20
    batch = ppo_batch(actors[0], _packed_batch(actors[0].module.config.vocab_size))
    shapes = []
    actors[1].module.register_forward_pre_hook(
        lambda _m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    real = batch.loss_mask.bool()
    lp, ent = actors[1].logprobs(batch, with_entropy=True)
    _, ent_padded = actors[0].logprobs(batch, with_entropy=True)
    torch.testing.assert_close(lp[real], batch.old_logprobs[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[real], ent_padded[real], rtol=0, atol=1e-5)
    assert lp.shape == ent.shape == batch.loss_mask.shape
    tokens = batch.attention_mask.sum() + 1  # the empty response runs one (masked) token
    assert all(s[0] == 1 and s[1] <= 20 for s in shapes) and sum(s[1] for s in shapes) == tokens
    assert tokens == 69 and len(shapes) == 4  # rows in order, each micro-batch filled up to the budget
    held, distinct, processed = actors[1].take_token_counts()["score"]
    assert held == distinct == processed == tokens
    grads = [accumulated_grads(a, batch) for a in actors]
    assert_same_gradients(grads[1], grads[0])


def test_a_pack_whose_rows_attend_across_each_other_fails_the_check(tiny_model_dir, monkeypatch):
    """The packed-rows check catches a pack whose positions run on across rows (transformers then
    sees one sequence and each row attends to the rows before it)."""
    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_dir)
    cfg = ds_config("reference", 0, "fp32", micro=12, total=12)
    ref = Reference(model, cfg)
    batch = _packed_batch(model.config.vocab_size)
    padded = ref.logprobs(batch)
    ref.packing = True
    real = batch.loss_mask.bool()
    torch.testing.assert_close(ref.logprobs(batch)[real], padded[real], rtol=0, atol=1e-5)
    pack_rows = policy.pack_rows

    def run_on(batch):
        inputs, keep, where = pack_rows(batch)
        n = inputs["position_ids"].shape[1]
        return {**inputs, "position_ids": torch.arange(n)[None]}, keep, where

    monkeypatch.setattr(policy, "pack_rows", run_on)
    assert float((ref.logprobs(batch)[real] - padded[real]).abs().max()) > 1e-2


def test_pack_by_tokens_fills_the_budget_with_rows_of_similar_length():
    """Every row once; a micro-batch's trimmed width (longest prompt + longest response) x rows fits
    the budget unless it is one row. Short and long rows taken in order pair up (8 micro-batches of
    width 16); sorted by length, the short ones share micro-batches (5: rows alike, so any
    micro-batch cost merges them)."""
    g = torch.Generator().manual_seed(0)
    cases = [
        (torch.randint(4, 41, (32,), generator=g), torch.randint(1, 31, (32,), generator=g), 200, None),
        (torch.tensor([2, 10] * 8), torch.tensor([2, 6] * 8), 32, 5),
    ]
    for plen, rlen, budget, want in cases:
        n, P, R = len(plen), int(plen.max()), int(rlen.max())
        attn = torch.zeros(n, P + R, dtype=torch.long)
        for i in range(n):
            attn[i, P - plen[i] : P + rlen[i]] = 1
        groups = pack_by_tokens(TrainBatch(attn, attn, attn[:, P:].float()), budget, cost=16)
        assert sorted(torch.cat(groups).tolist()) == list(range(n))
        for idx in groups:
            assert len(idx) == 1 or int(plen[idx].max() + rlen[idx].max()) * len(idx) <= budget
        assert want is None or len(groups) == want


def test_pack_by_tokens_keeps_the_row_order_when_that_runs_less():
    """Two candidates, the one with less work wins. Two prompts of 20 tokens, 4 answers each (1/3/5/7
    and 2/4/6/8): in row order (micro-batches of 4) each prompt runs once, sorted by length each
    micro-batch holds both prompts; with shared prompts the row order wins (or, over the budget, each
    prompt's rows together cut by length), without it the length order. Shared, a budget counts each
    prompt once: at 112 tokens all 8 rows fit one micro-batch (2 x 20 + 8 x 8 = 104). A long tail (one
    30-token answer per prompt): the length order puts the two long rows together, whether prompts are
    shared or not."""

    def batch(plen: list[int], rlen: list[int], prompt: list[int]) -> dict:
        n, P, R = len(plen), max(plen), max(rlen)
        ids, attn = torch.zeros(n, P + R, dtype=torch.long), torch.zeros(n, P + R, dtype=torch.long)
        for i in range(n):
            ids[i, P - plen[i] : P] = prompt[i] + 3  # rows of one prompt: the same prompt tokens
            attn[i, P - plen[i] : P + rlen[i]] = 1
        return TrainBatch(ids, attn, attn[:, P:].float())

    def cut(b, budget, shared=False):
        return [g.tolist() for g in pack_by_tokens(b, budget, shared, cost=128, rows_per_micro=4)]

    two = [0] * 4 + [1] * 4
    even = batch([20] * 8, [1, 3, 5, 7, 2, 4, 6, 8], two)
    assert cut(even, 56, shared=True) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 20 + 4 x 7 = 48 and 52 tokens
    assert cut(even, 112, shared=True) == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert cut(even, 112) == [[0, 4, 1, 5], [2, 6, 3, 7]]
    tail = batch([5] * 8, [1, 1, 1, 30] * 2, two)
    assert cut(tail, 140, shared=True) == cut(tail, 140) == [[0, 1, 2, 4, 5, 6], [3, 7]]
    # the row order over the budget (52) is not a candidate; each prompt's rows together, cut where they fit
    # (48, then 20 + 2 x 4 and 20 + 2 x 8), runs less than the length order's micro-batches of both prompts
    assert cut(even, 50, shared=True) == [[0, 1, 2, 3], [4, 5], [6, 7]]


def test_pack_by_tokens_cuts_where_the_padding_saved_outweighs_a_micro_batchs_cost():
    """Six short rows (5 + 2 tokens) and two long ones (5 + 30) fit one micro-batch of a large budget:
    280 tokens run, against 112 in two. The cut is taken when a micro-batch costs less than the 168
    padded tokens it saves (cost 16), not when it costs more (1000); the budget still bounds each."""
    rlen = [2] * 6 + [30] * 2
    P, R = 5, 30
    attn = torch.zeros(8, P + R, dtype=torch.long)
    for i in range(8):
        attn[i, : P + rlen[i]] = 1
    b = TrainBatch(attn, attn, attn[:, P:].float())
    assert [g.tolist() for g in pack_by_tokens(b, 1000, cost=16)] == [list(range(6)), [6, 7]]
    assert [g.tolist() for g in pack_by_tokens(b, 1000, cost=1000)] == [list(range(8))]
    assert [g.tolist() for g in pack_by_tokens(b, 70, cost=1000)] == [list(range(6)), [6, 7]]  # 8 x 35 > 70


@pytest.mark.numerics
@pytest.mark.parametrize("budget", [0, 24])
def test_accumulate_keeps_each_rows_logprobs_in_row_order(tiny_model_dir, budget):
    """`accumulate(..., keep=True)` hands back the training forward's logprobs of every row, in the
    batch's row order even when a token budget packs the rows out of order: the trainer's old
    logprobs of an on-policy batch. They equal the no-grad scoring pass's."""
    actor = Actor(load_causal_lm(tiny_model_dir), ds_config("actor", 0, "fp32"), Cfg())
    actor.max_tokens = budget
    batch = ppo_batch(actor, make_group_batch(actor.module.config.vocab_size))
    n = batch.input_ids.shape[0]
    if budget:  # the precondition: packing reorders the rows
        groups = actor.packed(batch)
        assert len(groups) > 1 and not torch.equal(torch.cat(groups), torch.arange(n))
    scored = actor.logprobs(batch)
    tokens = float(batch.loss_mask.sum())
    acc = actor.accumulate(batch, tokens, float(n), keep=True)
    assert acc.outputs is not None and acc.outputs.shape == scored.shape
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(acc.outputs[mask], scored[mask], rtol=0, atol=1e-5)
    assert actor.accumulate(batch, tokens, float(n)).outputs is None


def test_a_loss_names_the_fields_it_needs_instead_of_running_another_loss(tiny_model_dir):
    """A KL loss without reference logprobs, or an off-policy batch without old logprobs, is an error
    naming the field (a dict's missing key used to mean "no KL" or "on-policy", silently)."""
    actor = Actor(load_causal_lm(tiny_model_dir), ds_config("actor", 0, "fp32"), Cfg(use_kl_loss=True, kl_coef=0.1))
    batch = ppo_batch(actor, make_batch(actor.module.config.vocab_size))
    counts = dict(global_tokens=float(batch.loss_mask.sum()), global_seqs=4.0)
    with pytest.raises(ValueError, match="^the actor's loss needs ref_logprobs in the train batch$"):
        actor.micro_loss(batch, counts)
    with_ref = batch.replace(ref_logprobs=batch.old_logprobs)
    with pytest.raises(ValueError, match="^the actor's loss needs old_logprobs in the train batch$"):
        actor.micro_loss(with_ref.replace(old_logprobs=None), counts)
    loss, metrics, _ = actor.micro_loss(with_ref.replace(old_logprobs=None, on_policy=True), counts)
    assert math.isfinite(float(loss)) and abs(float(metrics["kl_loss"])) < 1e-6  # the reference is the policy
    critic = Critic(load_value_model(tiny_model_dir), ds_config("critic", 0, "fp32"), Cfg())
    with pytest.raises(ValueError, match="^the critic's loss needs old_values in the train batch$"):
        critic.micro_loss(batch.replace(old_values=None), counts)


def test_a_bf16_start_prints_nothing_of_deepspeeds_optimizer_memory(tiny_model_dir, capfd):
    """BF16_Optimizer's `see_memory_usage(force=True)` lines (DeepSpeed wraps a bf16 ZeRO-0 role without
    an optimizer in one: the reference) go to the debug log, not the console."""
    Reference(load_causal_lm(tiny_model_dir), ds_config("reference", 0, "bf16"))
    out = capfd.readouterr().out
    assert "bf16_optimizer" not in out and "CPU Virtual Memory" not in out and "MA " not in out, out
