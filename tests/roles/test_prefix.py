"""Shared prefixes (`roles/prefix.py`): a micro-batch's rows as a trie in one sequence, in every role's pass.
Exact against the unshared pass (summation order: `assert_same_gradients`, 1e-5 on fp32 outputs) at ZeRO 0
and 3, with gradient checkpointing on and off, with LoRA, for rows of unequal length, rows that share
nothing, an empty response and a multi-turn fork; each planted bug fails the same check."""

import dataclasses

import pytest
import torch
from deepspeed.utils import safe_get_full_grad

from tests.roles.helpers import Cfg, accumulated_grads, assert_same_gradients, ds_config
from verl_ds.roles import (
    Actor,
    Critic,
    Reference,
    RewardModel,
    load_causal_lm,
    load_reward_model,
    load_value_model,
    prefix,
)
from verl_ds.roles.attention import register as register_attention
from verl_ds.roles.batch import TrainBatch
from verl_ds.roles.lora import apply_lora


def test_the_trie_lays_each_shared_token_once_and_each_row_sees_its_own_path():
    """Rows 1 2 3 4 | 1 2 3 5 6 | 1 2 7 | 8 9, by hand: nodes [1 2] [3] [4] [5 6] [7] [8 9] in depth-first
    order, positions their depth, `end` where each node's subtree ends; each row reads its own tokens'
    places and attends to exactly its path."""
    rows = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7], [8, 9]]
    ids = torch.zeros(4, 5, dtype=torch.long)
    take = torch.zeros(4, 5, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)], take[i, : len(r)] = torch.tensor(r), True
    pack = prefix.pack(ids, take)
    assert pack.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert pack.position_ids.tolist() == [0, 1, 2, 3, 3, 4, 2, 0, 1]
    assert pack.end.tolist() == [7, 7, 6, 4, 6, 6, 7, 9, 9]
    assert (len(pack), pack.held) == (9, 14)
    assert pack.index[1].tolist() == [0, 1, 2, 4, 5] and pack.index[3].tolist() == [7, 8, -1, -1, -1]
    assert pack.pred[1].tolist() == [-1, 0, 1, 2, 4]
    sees = prefix.allowed(pack.end)
    for i, r in enumerate(rows):  # each row's last token sees exactly its row's places
        places = pack.index[i, : len(r)]
        assert set(sees[places[-1]].nonzero()[:, 0].tolist()) == set(places.tolist()), r


@pytest.mark.parametrize("seed", range(5))
def test_any_rows_lay_out_as_their_trie(seed):
    """Random rows over a 3-token alphabet (so they share prefixes of every depth, some rows whole, some
    twice), right-padded at random: the pack holds each distinct prefix once, and every held token of
    every row sits at its position and sees exactly the tokens of its row before it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 3, (12, 9), generator=g)
    ids[6:9] = ids[0]  # whole rows again
    take = torch.arange(9)[None] < torch.randint(1, 10, (12, 1), generator=g)
    pack = prefix.pack(ids, take)
    rows = [ids[i][take[i]].tolist() for i in range(len(ids))]
    assert len(pack) == len({tuple(r[: k + 1]) for r in rows for k in range(len(r))})
    sees = prefix.allowed(pack.end)
    for i, r in enumerate(rows):
        places = pack.index[i][take[i]]
        assert pack.input_ids[places].tolist() == r and pack.position_ids[places].tolist() == list(range(len(r)))
        for k, q in enumerate(places.tolist()):
            assert set(sees[q].nonzero()[:, 0].tolist()) == set(places[: k + 1].tolist())


def tree_batch(vocab: int, seed: int = 0) -> TrainBatch:
    """GRPO rows and more: 4 answers (1-4 tokens) to one 7-token prompt, one of them empty; 2 answers to a
    4-token prompt that share their first 3 tokens (a multi-turn fork); a row that shares nothing."""
    g = torch.Generator().manual_seed(seed)

    def tok(n: int, first: int | None = None) -> torch.Tensor:  # `first`: where rows must part
        t = torch.randint(3, vocab, (n,), generator=g)
        if first is not None and n:
            t[0] = first
        return t

    p1, p2, fork = tok(7, 3), tok(4, 4), tok(3)
    rows = [(p1, tok(r, 3 + i)) for i, r in enumerate((1, 4, 2))] + [(p1, tok(0))]
    rows += [(p2, torch.cat([fork, tok(2, 3)])), (p2, torch.cat([fork, tok(3, 4)])), (tok(3, 5), tok(4))]
    P, R = 7, 6
    ids, attn = torch.zeros(len(rows), P + R, dtype=torch.long), torch.zeros(len(rows), P + R, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        ids[i, P - len(p) : P], ids[i, P : P + len(r)] = p, r
        attn[i, P - len(p) : P + len(r)] = 1
    return TrainBatch(ids, attn, attn[:, P:].float())


def _shared(role):
    role.share_prefixes, role.share_min_tokens = True, 0
    shapes = []
    role.module.register_forward_pre_hook(
        lambda _m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    return shapes


def _ppo(batch: TrainBatch, lp: torch.Tensor) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(lp.shape, generator=g)
    return batch.replace(old_logprobs=lp, advantages=adv, returns=adv, old_values=torch.zeros_like(lp))


def distinct(batch: TrainBatch, first_response: bool = True) -> int:
    """The tree batch's tokens, each shared prefix once: its rows' distinct prefixes, counted as sets."""
    take = prefix.held_columns(batch.attention_mask, batch.response_width, first_response)
    rows = [batch.input_ids[i][take[i]].tolist() for i in range(len(batch))]
    return len({tuple(r[: k + 1]) for r in rows for k in range(len(r))})


DISTINCT = 7 + 1 + 4 + 2 + 1 + 4 + 3 + 2 + 3 + 7  # by hand, unless two random tokens happen to agree


def _actors(model_dir: str, stage: int, gc: bool, lora: bool = False, micro: int = 7, attn: str = "sdpa"):
    cfg = ds_config("actor", stage, "fp32", micro=micro, total=micro)
    out = []
    for _ in range(2):
        model = load_causal_lm(model_dir, grad_checkpointing=gc, attn_implementation=attn)
        if lora:
            torch.manual_seed(0)
            model = apply_lora(model, 4, 8.0, 0.0, ["q_proj", "v_proj"], [])
            for name, p in model.named_parameters():  # B starts at 0, which leaves A no gradient
                if "lora_B" in name:
                    torch.nn.init.normal_(p, std=0.1)
        out.append(Actor(model, cfg, Cfg(entropy_coef=0.01)))
        out[-1].attention = attn  # as the builder sets it
    return out


@pytest.mark.numerics
@pytest.mark.parametrize(("stage", "gc"), [(0, False), (0, True), (3, True)])
@pytest.mark.parametrize("attn", ["sdpa", "per_row"])
def test_shared_actor_scores_and_trains_as_the_plain_actor(tiny_model_dir, monkeypatch, stage, gc, attn):
    """One micro-batch of the tree batch: the shared pass runs its 34 distinct tokens in one `[1, 34]`
    sequence against 62 the rows hold; logprobs and entropies of every response token, and the accumulated
    gradient (with an entropy bonus), equal the plain pass's; the token counts say what ran. With SDPA over the
    pack's mask, and per row (`sdpa_cpu16`'s route for 16-bit passes, taken here in fp32: `prefix.by_path`,
    10 rows of at most 7 tokens against 34 places), checkpointed recomputes included."""
    if attn == "per_row":
        register_attention()
        monkeypatch.setattr(prefix, "runs_per_row", lambda implementation, _dtype: implementation == "sdpa_cpu16")
        attn = "sdpa_cpu16"
    plain, shared = _actors(tiny_model_dir, stage, gc, attn=attn)
    shapes = _shared(shared)
    batch = tree_batch(plain.module.config.vocab_size)
    real = batch.loss_mask.bool()
    lp, ent = plain.logprobs(batch, with_entropy=True)
    lp_s, ent_s = shared.logprobs(batch, with_entropy=True)
    assert distinct(batch) == DISTINCT and shapes == [(1, DISTINCT)]
    torch.testing.assert_close(lp_s[real], lp[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_s[real], ent[real], rtol=0, atol=1e-5)
    held = float(batch.attention_mask.sum() + 1)  # the empty response scores one (masked) column
    assert shared.take_token_counts()["score"] == (held, DISTINCT, DISTINCT)
    batch = _ppo(batch, lp)
    assert_same_gradients(accumulated_grads(shared, batch), accumulated_grads(plain, batch))


@pytest.mark.numerics
def test_flex_attention_shares_through_its_block_mask_as_the_plain_pass(tiny_model_dir):
    """FlexAttention (the GPU's route for rows that share prefixes: varlen flash-attention cannot express
    "the prefix plus my own tokens"), run on the CPU where it can: scoring. The shared pass takes the block
    mask made from the pack's rule (`prefix.attention_mask`) in one `[1, 34]` sequence; its logprobs and
    entropies equal the plain SDPA pass's. FlexAttention runs uncompiled (its reference implementation, the
    same mask and score semantics): what is under test is the mask, and inductor's CPU template computes
    other numbers under forced AVX2 kernels. Dynamo itself stays on (an in-process vLLM engine earlier in
    the session turns it off), since eager FlexAttention still traces its mask through it."""
    plain, _ = _actors(tiny_model_dir, 0, False)
    flex, _ = _actors(tiny_model_dir, 0, False, attn="flex_attention")
    flex.attention = "flex_attention"
    shapes = _shared(flex)
    batch = tree_batch(plain.module.config.vocab_size)
    real = batch.loss_mask.bool()
    lp, ent = plain.logprobs(batch, with_entropy=True)
    with torch._dynamo.config.patch(disable=False), torch.compiler.set_stance("force_eager"):
        lp_s, ent_s = flex.logprobs(batch, with_entropy=True)
    assert shapes == [(1, DISTINCT)]
    torch.testing.assert_close(lp_s[real], lp[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_s[real], ent[real], rtol=0, atol=1e-5)


@pytest.mark.numerics
def test_shared_lora_actor_trains_as_the_plain_one(tiny_model_dir):
    """LoRA adapters on q/v (ZeRO-0, checkpointing on): the adapters' gradients equal the plain pass's."""
    plain, shared = _actors(tiny_model_dir, 0, True, lora=True)
    _shared(shared)
    batch = tree_batch(plain.module.config.vocab_size, seed=2)
    batch = _ppo(batch, plain.logprobs(batch))
    tokens, rows = float(batch.loss_mask.sum()), float(len(batch))
    grads = []
    for actor in (shared, plain):
        actor.accumulate(batch, global_tokens=tokens, global_seqs=rows)
        trained = [(n, p) for n, p in actor.module.named_parameters() if p.requires_grad]
        grads.append({n: safe_get_full_grad(p).float().clone() for n, p in trained})
    assert grads[1] and all("lora_" in n for n in grads[1])
    assert_same_gradients(*grads)


@pytest.mark.numerics
@pytest.mark.parametrize("gc", [False, True])
def test_shared_critic_values_and_gradients_equal_the_plain_critic(tiny_model_dir, gc):
    """The critic's values V(state before each response token) and its gradient, shared against plain
    (the value head set non-zero so the values say something)."""
    cfg = ds_config("critic", 0, "fp32", micro=7, total=7)
    critics = []
    for _ in range(2):
        model = load_value_model(tiny_model_dir, grad_checkpointing=gc)
        torch.manual_seed(0)
        torch.nn.init.normal_(model.v_head.weight, std=0.5)
        critics.append(Critic(model, cfg, Cfg()))
    plain, shared = critics
    shapes = _shared(shared)
    batch = tree_batch(plain.module.backbone.config.vocab_size, seed=3)
    real = batch.loss_mask.bool()
    v, v_s = plain.values(batch), shared.values(batch)
    assert shapes == [(1, distinct(batch))] and float(v[real].abs().max()) > 1e-3
    torch.testing.assert_close(v_s[real], v[real], rtol=0, atol=1e-5)
    batch = _ppo(batch, torch.zeros_like(v)).replace(old_values=v, returns=v + 1)
    assert_same_gradients(accumulated_grads(shared, batch), accumulated_grads(plain, batch))


@pytest.mark.numerics
def test_shared_reward_scores_equal_the_plain_scores(tiny_model_dir, tmp_path):
    """A reward model's scores, read where HF pools (the last token that is not its pad id), shared
    against plain, at ZeRO-0 and ZeRO-3 (its pass runs the backbone and the head apart)."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    torch.nn.init.normal_(rm.score.weight, std=0.5)
    rm.save_pretrained(tmp_path)
    for stage in (0, 3):
        cfg = ds_config("reward", stage, "fp32", micro=7, total=7)
        plain, shared = (RewardModel(load_reward_model(str(tmp_path)), cfg) for _ in range(2))
        _shared(shared)
        batch = tree_batch(rm.config.vocab_size, seed=4)
        s, s_shared = plain.score(batch), shared.score(batch)
        assert shared.take_token_counts()["score"][1] == distinct(batch, first_response=False)
        assert float(s.std()) > 1e-3
        torch.testing.assert_close(s_shared, s, rtol=0, atol=1e-5)


def _restart_own_positions(pack_fn):
    """Planted: each node's tokens get positions from 0 (a row's own tokens restart)."""

    def planted(*args):
        p = pack_fn(*args)
        pos = p.position_ids.clone()
        start = 0
        for k in range(1, len(pos) + 1):
            if k == len(pos) or int(p.end[k]) != int(p.end[k - 1]) or int(pos[k]) != int(pos[k - 1]) + 1:
                pos[start:k] -= int(pos[start])
                start = k
        return dataclasses.replace(p, position_ids=pos)

    return planted


def _causal_paths(pack_fn):
    """Planted, per row (`prefix.by_path`): each row's path is every place up to its last (its siblings' too)."""

    def planted(*args):
        p = pack_fn(*args)
        last = p.paths.max(1).values
        width = int(last.max()) + 1
        places = torch.arange(width)[None].expand(len(last), width)
        return dataclasses.replace(p, paths=torch.where(places <= last[:, None], places, -1))

    return planted


@pytest.mark.numerics
@pytest.mark.parametrize("attend", ["pack", "per_row"])
@pytest.mark.parametrize("bug", ["sibling_attention", "restarted_positions", "prefix_gradient_from_one_row"])
def test_each_planted_bug_fails_the_check(tiny_model_dir, monkeypatch, bug, attend):
    """The checks above catch, with the pack's attention over its mask and per row (`prefix.by_path`): a row
    attending to its siblings' tokens (plain causal attention over the pack), positions of a row's own tokens
    restarting at 0, a shared position's gradient taken from one row only (the others read it detached)."""
    monkeypatch.setattr(prefix, "by_path", lambda _p: attend == "per_row")
    monkeypatch.setattr(prefix, "runs_per_row", lambda implementation, _dtype: implementation == "sdpa_cpu16")
    register_attention()
    plain, shared = _actors(tiny_model_dir, 0, False, attn="sdpa_cpu16")
    _shared(shared)
    batch = tree_batch(plain.module.config.vocab_size)
    real = batch.loss_mask.bool()
    lp = plain.logprobs(batch)
    if bug == "sibling_attention" and attend == "per_row":
        monkeypatch.setattr(prefix, "pack", _causal_paths(prefix.pack))
    elif bug == "sibling_attention":
        monkeypatch.setattr(prefix, "allowed", lambda end: torch.ones(len(end), len(end), dtype=torch.bool).tril())
    elif bug == "restarted_positions":
        monkeypatch.setattr(prefix, "pack", _restart_own_positions(prefix.pack))
    else:  # the LM head reads each repeated place detached after its first reader
        head = shared.module.get_output_embeddings()
        response = prefix.PrefixPack.response
        seen = {}

        def remember(self, width):
            keep, where = response(self, width)
            seen["keep"] = keep
            return keep, where

        def detach_repeats(_m, args):
            keep, h = seen["keep"], args[0]
            first = torch.zeros(len(keep), dtype=torch.bool)
            first[[keep.tolist().index(k) for k in keep.unique().tolist()]] = True
            return (torch.where(first[None, :, None], h, h.detach()),)

        monkeypatch.setattr(prefix.PrefixPack, "response", remember)
        head.register_forward_pre_hook(detach_repeats)
    got = shared.logprobs(batch)
    if bug == "prefix_gradient_from_one_row":  # the values are right; the gradient is not
        torch.testing.assert_close(got[real], lp[real], rtol=0, atol=1e-5)
        batch = _ppo(batch, lp)
        with pytest.raises(AssertionError, match="max \\|diff\\|"):
            assert_same_gradients(accumulated_grads(shared, batch), accumulated_grads(plain, batch))
    else:
        assert float((got[real] - lp[real]).abs().max()) > 1e-3


@pytest.mark.numerics
def test_a_bf16_pass_sharing_short_prefixes_per_row_is_the_plain_pass_bit_for_bit(tiny_model_dir, monkeypatch):
    """A bf16 reference on `sdpa_cpu16` (the CPU's default): the tree batch's short prefixes shared, the attention
    run per row (`prefix.by_path`) gives the plain pass's logprobs bit for bit where the CPU has bf16 kernels
    (avx512_bf16/AMX: a row's GEMM result does not depend on the rows beside it), as a matched 16-bit pair needs,
    and the same pack under its one `[N, N]` mask does not (another kernel shape: a rounding apart); with bf16
    emulated (AVX2) within bf16's probe bound."""
    from verl_ds import algos
    from verl_ds.precision import detect_hardware

    register_attention()
    cfg = ds_config("reference", 0, "bf16", micro=10, total=10)
    plain, shared = (Reference(load_causal_lm(tiny_model_dir, attn_implementation="sdpa_cpu16"), cfg) for _ in range(2))
    for role in (plain, shared):
        role.attention = "sdpa_cpu16"
    shapes = _shared(shared)
    batch = tree_batch(plain.module.config.vocab_size)
    real = batch.loss_mask.bool()
    lp = plain.logprobs(batch)
    assert lp.dtype == torch.float32 and next(shared.module.parameters()).dtype == torch.bfloat16
    got = shared.logprobs(batch)
    assert shapes == [(1, DISTINCT)]
    if not detect_hardware("cpu").cpu_bf16:
        assert float((got[real] - lp[real]).abs().max()) <= algos.probe_bound("bf16", "bf16")
        return
    assert torch.equal(got[real], lp[real])
    monkeypatch.setattr(prefix, "by_path", lambda _p: False)
    shared._last_pack = (None, None)
    assert float((shared.logprobs(batch)[real] - lp[real]).abs().max()) > 0


def test_a_micro_batch_that_shares_too_little_runs_the_plain_pass(tiny_model_dir):
    """Rows that share less than `share_min_tokens` a row: the plain padded pass, and the counts say
    nothing was shared; the cost rule prefers the plain pass where long rows make the pack's square
    attention dearer than what it saves."""
    cfg = ds_config("reference", 0, "fp32", micro=8, total=8)
    ref = Reference(load_causal_lm(tiny_model_dir), cfg)
    shapes = _shared(ref)
    batch = tree_batch(ref.module.config.vocab_size)
    ref.share_min_tokens = 9  # sharing saves 57 tokens of the plain pass's 7 rows x 13: 8.1 a row
    ref.logprobs(batch)
    assert distinct(batch) == DISTINCT and shapes == [(7, 13)]
    held, once, run = ref.take_token_counts()["score"]
    assert held == once == 62 and run == 7 * 13
    ref.share_min_tokens = 8
    ref.logprobs(batch)
    assert shapes[-1] == (1, DISTINCT)
    take = torch.ones(2, 4096, dtype=torch.bool)
    ids = torch.cat([torch.zeros(2, 1000, dtype=torch.long), torch.arange(2 * 3096).view(2, 3096) + 1], 1)
    long_tails = prefix.pack(ids, take)  # 1,000 shared tokens, 3,096 apart: N = 7,192 against 2 x 4,096
    assert len(long_tails) == 7192
    rows = prefix.sort_rows(ids, take)
    assert rows.distinct == 7192
    assert not prefix.pays(rows, take, hidden_size=64, min_saved=0)
    assert prefix.pays(rows, take, hidden_size=4096, min_saved=0)  # big projections: the tokens win
    assert not prefix.pays(rows, take, hidden_size=4096, min_saved=501)  # 1,000 saved: 500 a row
    # attention per row (`sdpa_cpu16`, `prefix.by_path`) attends the plain pass's pairs: the saved tokens win
    assert prefix.pays(rows, take, hidden_size=64, min_saved=0, per_row=True)
