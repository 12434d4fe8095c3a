"""HFRollout: same interface as VLLMRollout, checked against a manual HF forward."""

import pytest
import torch

from tests.rollout.helpers import PROMPTS, load_hf, max_logprob_diff
from verl_ds.algos import TokenDist, processed_logprobs
from verl_ds.rollout import HFRollout, prompt_seeds
from verl_ds.rollout.engines.hf_rollout import inverse_cdf_sample


@pytest.fixture(scope="module")
def hf(model_pair):
    return HFRollout(model_pair[0], "fp32")


@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_manual_forward(hf, model_pair, temperature):
    seeds = prompt_seeds(1, 3, range(len(PROMPTS)))
    batch = hf.generate(PROMPTS, n=2, temperature=temperature, max_new_tokens=8, seeds=seeds)
    assert len(batch) == 8 and batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert max_logprob_diff(load_hf(model_pair[0]), batch, temperature) <= 1e-4
    for row, reason in zip(batch.to_lists()["responses"], batch.finish_reasons):
        assert (reason == "stop") == (row[-1] == 2) and 2 not in row[:-1]  # eos ends and is kept
    assert hf.last_metrics["perf/rollout_tokens_per_s"] > 0
    again = hf.generate(PROMPTS, n=2, temperature=temperature, max_new_tokens=8, seeds=seeds)
    assert torch.equal(again.response_ids, batch.response_ids)


@pytest.mark.numerics
@pytest.mark.parametrize("temperature,top_p,seeded", [(0.0, 1.0, True), (0.7, 0.9, True), (1.0, 0.8, False)])
def test_logprobs_equal_the_full_logits_computation_without_keeping_the_logits(
    hf, monkeypatch, temperature, top_p, seeded
):
    """`generate` is not asked for every step's [B, V] logits (O(B·T·V) on the device), yet each
    response token's logprob equals, bit for bit at fp32, the straightforward computation from those
    full logits: `processed_logprobs` of the stacked logits, gathered at the sampled tokens. Greedy,
    per-prompt streams with top-p, and `generate`'s own sampling; rows that stop early included."""
    real, seen = hf.model.generate, {}

    def generate_keeping_logits(**kw):  # the oracle: the same call, with HF's own full-logits output
        assert not kw.get("output_logits") and not kw.get("output_scores") and not kw.get("return_dict_in_generate")
        torch.manual_seed(0)  # the unseeded path samples from the global RNG: same draws in both runs
        seen["out"] = real(**kw, output_logits=True, return_dict_in_generate=True)
        return seen["out"].sequences

    monkeypatch.setattr(hf.model, "generate", generate_keeping_logits)
    seeds = prompt_seeds(1, 5, range(len(PROMPTS))) if seeded else None
    batch = hf.generate(PROMPTS, n=3, temperature=temperature, top_p=top_p, max_new_tokens=8, seeds=seeds)
    out = seen["out"]
    seq = out.sequences[:, -len(out.logits) :]
    full = processed_logprobs(torch.stack(out.logits, dim=1), TokenDist(temperature, 0, top_p))  # [B, T, V]
    want = full.gather(-1, seq.unsqueeze(-1)).squeeze(-1)
    rows = batch.to_lists()
    assert {"stop", "length"} <= set(batch.finish_reasons) or temperature == 0  # early stops are covered
    for i, (resp, lp) in enumerate(zip(rows["responses"], rows["logprobs"])):
        assert resp == seq[i, : len(resp)].tolist()
        assert lp == want[i, : len(resp)].tolist(), i  # bitwise: the same fp32 values


@pytest.mark.numerics
def test_sync_and_bad_sync(hf, model_pair):
    new = load_hf(model_pair[1])
    assert hf.sync_weights(new.named_parameters())["timing_s/update_weights"] > 0
    batch = hf.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=6)
    assert max_logprob_diff(new, batch, 0.0) <= 1e-5
    with pytest.raises(ValueError, match="module.model.norm.weight"):
        hf.sync_weights([("module.model.norm.weight", torch.zeros(64))])
    with pytest.raises(ValueError, match="shape"):
        hf.sync_weights([("model.norm.weight", torch.zeros(3))])
    hf.sync_weights(load_hf(model_pair[0]).named_parameters())


def test_a_sync_into_a_copy_of_the_model_stops_the_run(model_pair):
    """The sync check reads the generating module back: weights copied into anything else (here a
    state dict detached from the model) fail the sync in one line naming a parameter."""
    import copy

    from verl_ds.errors import RunFailure

    hf = HFRollout(model_pair[0], "fp32")
    new = load_hf(model_pair[1])
    m = hf.sync_weights(new.named_parameters())
    assert m["rollout/sync_checked_params"] == len(list(new.named_parameters())) and m["timing_s/sync_check"] > 0
    hf.sync_weights(load_hf(model_pair[0]).named_parameters())
    detached = copy.deepcopy(hf.model)
    hf.model.state_dict = detached.state_dict  # the copy goes astray
    with pytest.raises(
        RunFailure, match=r"^weight sync: the rollout engine does not hold the actor's \S+ after sync 3"
    ):
        hf.sync_weights(new.named_parameters())


def test_the_sync_fingerprint_reads_a_bounded_sample_that_covers_every_row():
    """A sync's check reads at most FINGERPRINT_VALUES values per tensor (an embedding of ~49k x 576
    once read 28M values in float64 per sync), yet a change to any one row of a matrix whose rows are
    longer than the stride still changes the fingerprint; equal values give equal fingerprints."""
    from verl_ds.rollout.engines.weights import FINGERPRINT_VALUES, fingerprint, same_fingerprint

    g = torch.Generator().manual_seed(0)
    t = torch.randn(FINGERPRINT_VALUES // 64, 576, generator=g)  # 9 x the sample: stride 9 < 576
    assert same_fingerprint(fingerprint(t.clone()), fingerprint(t))
    for row in (0, 1, t.shape[0] // 2, t.shape[0] - 1):
        moved = t.clone()
        moved[row] += 1e-3 * torch.randn(576, generator=g)  # one row updated, as a stale row would differ
        assert not same_fingerprint(fingerprint(moved), fingerprint(t)), row
    unread = t.clone()
    unread.view(-1)[1] += 1.0  # between two sampled positions: the sample is what bounds the cost
    assert same_fingerprint(fingerprint(unread), fingerprint(t))
    small = torch.randn(100, generator=g)  # under the bound: every value is read
    for i in range(100):
        moved = small.clone()
        moved[i] += 1e-3
        assert not same_fingerprint(fingerprint(moved), fingerprint(small)), i


@pytest.mark.numerics
def test_inverse_cdf_sample_follows_the_distribution():
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]])).expand(10_000, 4)
    u = (torch.arange(10_000, dtype=torch.float64) + 0.5) / 10_000  # an even grid over [0, 1)
    counts = torch.bincount(inverse_cdf_sample(lp, u), minlength=4)
    assert counts.tolist() == [5000, 3000, 2000, 0]  # exact shares; p = 0 never drawn
    assert inverse_cdf_sample(lp[:1], torch.tensor([1.0])).item() == 2  # u near 1: last nonzero


@pytest.mark.numerics
def test_each_prompt_samples_from_its_own_stream(hf, model_pair):
    """A prompt's samples depend on its seed only: not on the other prompts of the call, their
    order, or how the prompts are split between calls (ranks). The draws follow the model."""
    seeds = prompt_seeds(1, 0, range(len(PROMPTS)))
    kw = dict(n=3, temperature=1.0, max_new_tokens=6)

    def per_prompt(batch, order):
        rows = batch.to_lists()["responses"]
        return {order[g]: [r for r, gid in zip(rows, batch.group_ids.tolist()) if gid == g] for g in range(len(order))}

    whole = per_prompt(hf.generate(PROMPTS, seeds=seeds, **kw), [0, 1, 2, 3])
    order = [2, 0, 3, 1]
    shuffled = per_prompt(hf.generate([PROMPTS[i] for i in order], seeds=[seeds[i] for i in order], **kw), order)
    split = {
        **per_prompt(hf.generate(PROMPTS[:1], seeds=seeds[:1], **kw), [0]),
        **per_prompt(hf.generate(PROMPTS[1:], seeds=seeds[1:], **kw), [1, 2, 3]),
    }
    assert whole == shuffled == split
    assert len({tuple(r) for rows in whole.values() for r in rows}) > 4  # samples differ within and across prompts
    # first tokens of 8000 samples of one prompt against the model's own distribution at T = 0.5
    # (total variation ~0.02 measured; 0.12 against the T = 1 distribution, 0.2 against uniform)
    batch = hf.generate(PROMPTS[:1], n=8000, temperature=0.5, max_new_tokens=1, seeds=[7])
    logits = load_hf(model_pair[0])(torch.tensor([PROMPTS[0]])).logits[0, -1].float()
    probs = torch.softmax(logits / 0.5, -1)
    freq = torch.bincount(batch.response_ids[:, 0], minlength=probs.numel()).double() / 8000
    assert 0.5 * (freq - probs.double()).abs().sum() < 0.05


def test_make_rollout_and_local_generation(model_pair):
    from verl_ds.config import RolloutConfig
    from verl_ds.rollout import generate_distributed, make_rollout

    hf = make_rollout(RolloutConfig(engine="hf"), model_pair[0], "fp32", seed=0)
    assert isinstance(hf, HFRollout) and hf.tp == 1
    a = generate_distributed(
        hf, [[1, 5], [1, 6]], n=4, temperature=1.0, top_p=1.0, max_new_tokens=6, run_seed=1, step=0
    )
    b = generate_distributed(
        hf, [[1, 5], [1, 6]], n=4, temperature=1.0, top_p=1.0, max_new_tokens=6, run_seed=1, step=0
    )
    c = generate_distributed(
        hf, [[1, 5], [1, 6]], n=4, temperature=1.0, top_p=1.0, max_new_tokens=6, run_seed=1, step=1
    )
    assert len(a) == 8 and torch.equal(a.response_ids, b.response_ids)  # same (seed, step): same samples
    assert (
        not torch.equal(a.response_ids, c.response_ids[:, : a.response_ids.shape[1]])
        or a.response_ids.shape != c.response_ids.shape
    )  # next step: a new stream


def test_prompt_seeds_are_unique_and_spaced():
    seeds = [s for step in range(50) for s in prompt_seeds(1, step, range(64))]
    assert len(set(seeds)) == len(seeds)
    ordered = sorted(seeds)
    assert min(b - a for a, b in zip(ordered, ordered[1:])) > 1024  # vLLM's per-sample streams s..s+n-1
    assert prompt_seeds(1, 3, [5]) == prompt_seeds(1, 3, [5]) != prompt_seeds(2, 3, [5])
