"""Partial rollouts (`rollout.partial`) on real engines: HF generate over a tiny model, real DeepSpeed
roles. The pool's scheduling is checked on the engine alone; the trainer checks the synchronous
equivalence at max_staleness 0, the rollout-vs-trainer gap of resumed episodes, and exact resume."""

import json
import math

import pytest

from verl_ds.config import load_config
from verl_ds.errors import ConfigError
from verl_ds.rollout import HFRollout
from verl_ds.rollout.episodes import Sampling
from verl_ds.rollout.partial import PartialLimits, PartialRollouts
from verl_ds.trainer.rl_trainer import RLTrainer

FP32 = [f"precision.{k}_dtype=fp32" for k in ("actor", "reference", "rollout", "buffer")]
TINY = ["model.tiny.hidden=32", "model.tiny.ffn=64", "logging.wandb.mode=disabled", "rollout.engine=hf"]
# a random char-level model ends a sample (eos) at random: lengths spread up to max_new_tokens
JOB = [
    *TINY,
    *FP32,
    "trainer.prompts_per_step=4",
    "rollout.n=2",
    "rollout.max_new_tokens=24",
    "rollout.temperature=1.5",
    "trainer.val_every=0",
    "trainer.val_before_train=false",
    "checkpoint.every=0",
    "algorithm.tis_cap=2.0",  # both sides weigh by the rollout logprobs: the synchronous step too
]
PARTIAL = [
    "rollout.partial.enabled=true",
    "rollout.partial.max_staleness=2",
    "rollout.partial.over_provision=2.0",
    "rollout.partial.chunk_tokens=4",
    "rollout.partial.tail_fraction=1.0",  # cut the moment a step can train: episodes pause in so small a batch
]
NOT_COMPARED = ("timing_s/", "perf/", "memory/", "partial/")
# a retry environment: several turns per episode, so pauses fall inside turns and between them
MULTI_TURN = [
    "rollout.multi_turn.env=tests.trainer.partial_env:CountingRetry",
    "rollout.multi_turn.max_turns=3",
    "rollout.max_new_tokens=8",
    "data.reward_fn=none",
    "rollout.partial.chunk_tokens=3",  # (in effect only with rollout.partial.enabled)
    "algorithm.tis_mode=mask",  # AReaL's decoupled loss: a token whose behaviour weight passes the cap drops out
]
# an agent written with the openai client (three calls, tools offered): its calls wait on the
# endpoint through the steps it spans, and may be cut inside a call
AGENT = [
    "model.tiny.tokenizer=chat",
    "data.apply_chat_template=true",
    "data.reward_fn=none",
    "rollout.multi_turn.agent=tests.e2e.agents:three_calls",
    "rollout.max_new_tokens=8",
    "rollout.partial.chunk_tokens=3",
]
JOBS = {"single_turn": [], "multi_turn": MULTI_TURN}


def _run(run_dir, overrides: list[str], steps: int) -> list[dict]:
    cfg = load_config(None, [*JOB, f"trainer.run_dir={run_dir}", f"trainer.steps={steps}", *overrides])
    with RLTrainer(cfg) as trainer:
        trainer.fit()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same(a: dict, b: dict) -> dict:
    """The keys of `a` and `b` (timings and partial/* aside) whose values differ."""
    keys = {k for k in a.keys() | b.keys() if not k.startswith(NOT_COMPARED)}
    return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFRollout(str(tiny_model_dir), "fp32")


def _pool(engine, tokenizer, staleness: int, in_flight: int, per_step: int = 2, tail: float = 1.0) -> PartialRollouts:
    prompts = [{"prompt_ids": tokenizer(f"{i}+{i}=")["input_ids"], "i": i} for i in range(64)]
    cursor = iter(range(10_000))
    limits = PartialLimits(per_step, staleness, in_flight, chunk_tokens=3, tail_fraction=tail)
    return PartialRollouts(
        engine, limits, prompts, lambda: [next(cursor) % 64 for _ in range(per_step)], Sampling(2, 1.5, 1.0, 48), 3
    )


def test_the_pool_bounds_staleness_drops_nothing_and_continues_paused_episodes(engine, tokenizer):
    pool = _pool(engine, tokenizer, staleness=2, in_flight=6)
    trained, paused_prefix, spans = [], {}, 0
    for version in range(8):
        ro, examples = pool.collect(version)
        m = ro.metrics
        assert len(examples) == 2 and len(ro.batch) == 4  # the step's groups, whole (n=2 each)
        assert m["partial/staleness/max"] <= 2  # admission bounds it: a group trains within 2 versions
        assert m["partial/in_flight_groups"] <= 6 - 2
        spans += m["partial/resumed_fraction"] > 0
        rows = ro.batch.to_lists()["responses"]
        for ex, (a, b) in zip(examples, zip(rows[0::2], rows[1::2])):
            trained.append(ex["i"])
            for j, row in enumerate((a, b)):
                prefix = paused_prefix.pop((ex["i"], j), None)
                if prefix is not None:  # what was kept at the pause is the start of what trains
                    assert row[: len(prefix)] == prefix and len(row) > len(prefix)
        for g in pool.pool:  # what stays in flight, as far as it got
            for j, ep in enumerate(g.episodes):
                if ep.live and ep.pending:
                    paused_prefix[(g.index % 64, j)] = list(ep.pending.ids)
                    assert len(ep.versions) == len(ep.pending.ids) and max(ep.versions) <= version
    assert spans > 0, "no episode was paused and resumed on later weights"
    left = [g.index for g in pool.pool]
    assert sorted(trained + left) == list(range(16 + len(left))), "every admitted group trains or is in flight"


def test_a_step_cuts_its_stream_only_in_its_tail(engine, tokenizer):
    """`tail_fraction`: at 1.0 a step cuts what runs the moment it can train (episodes wait in flight
    half-sampled, their contexts re-sent next step); near 0 it lets every running episode end, so
    nothing waits half-sampled and nothing is re-sent, while groups still wait in flight, whole."""
    for tail, cuts in ((1.0, True), (1e-9, False)):
        pool, half, resent, waiting = _pool(engine, tokenizer, staleness=2, in_flight=6, tail=tail), 0, 0.0, 0
        for version in range(6):
            ro, _ = pool.collect(version)
            resent += ro.metrics["partial/resent_tokens"]
            half += sum(bool(ep.pending) for g in pool.pool for ep in g.episodes)
            waiting += len(pool.pool)
        assert (half > 0, resent > 0) == (cuts, cuts), (tail, half, resent)
        assert waiting > 0


@pytest.mark.numerics
def test_a_paused_episode_continues_as_if_never_paused(engine, tokenizer):
    """Greedy, on unchanged weights: episodes paused every 3 tokens (their context re-sent as ids,
    the KV recomputed) end as the same tokens with the same logprobs as episodes never paused."""
    prompts = [{"prompt_ids": tokenizer(f"{i}+{i}=")["input_ids"]} for i in range(32)]

    def rows(chunk: int, staleness: int) -> dict[tuple, tuple]:
        cursor = iter(range(100))
        limits = PartialLimits(4, staleness, 8, chunk_tokens=chunk, tail_fraction=1.0)
        pool = PartialRollouts(
            engine, limits, prompts, lambda: [next(cursor) for _ in range(4)], Sampling(1, 0.0, 1.0, 16), 3
        )
        out = {}
        for version in range(3):  # the weights never change: versions are only labels here
            ro, examples = pool.collect(version)
            lists = ro.batch.to_lists()
            out.update(
                {tuple(e["prompt_ids"]): (r, lp) for e, r, lp in zip(examples, lists["responses"], lists["logprobs"])}
            )
        return out

    paused, whole = rows(chunk=3, staleness=2), rows(chunk=16, staleness=0)
    common = paused.keys() & whole.keys()
    assert len(common) >= 8 and any(len(whole[k][0]) > 3 for k in common)  # some were really paused
    assert all(paused[k][0] == whole[k][0] for k in common)
    gap = max(abs(a - b) for k in common for a, b in zip(paused[k][1], whole[k][1]))
    assert gap <= 1e-5, gap


def test_a_zero_staleness_pool_keeps_nothing_in_flight(engine, tokenizer):
    pool = _pool(engine, tokenizer, staleness=0, in_flight=6)
    for version in range(3):
        ro, _ = pool.collect(version)
        assert ro.metrics["partial/staleness/max"] == 0 and ro.metrics["partial/rounds"] == 1
        assert pool.pool == []


@pytest.mark.numerics
@pytest.mark.parametrize("job", sorted(JOBS))
def test_max_staleness_zero_is_the_synchronous_step_bitwise(tmp_path, job):
    sync = _run(tmp_path / "sync", JOBS[job], steps=3)
    part = _run(tmp_path / "part", [*PARTIAL, *JOBS[job], "rollout.partial.max_staleness=0"], steps=3)
    assert [_same(a, b) for a, b in zip(sync, part)] == [{}, {}, {}]


@pytest.mark.numerics
@pytest.mark.parametrize("job", ["multi_turn", "single_turn"])
def test_resumed_episodes_score_as_sampled_and_a_resumed_run_continues_exactly(tmp_path, job):
    partial = [*PARTIAL, *JOBS[job]]
    # lr 0: the weights never change, so every token's rollout logprob must equal the trainer's on
    # the row as assembled, including tokens sampled after a pause from the kept ids
    frozen = _run(tmp_path / "frozen", [*partial, "roles.actor.lr=0.0"], steps=3)
    assert max(m["partial/resumed_fraction"] for m in frozen) > 0
    assert all(m["rollout_corr/logprob_abs_diff_max"] < 1e-5 for m in frozen)
    if job == "multi_turn":  # rows continued across pauses are still the one-shot rendering
        assert all(m["multi_turn/token_mismatch_fraction"] == 0 and m["multi_turn/turns/max"] > 1 for m in frozen)
    # kill-free resume: 4 steps straight, against 2 steps, a checkpoint, and 2 more from it (the
    # environments of episodes in flight rebuilt by replaying their actions)
    straight = _run(tmp_path / "straight", partial, steps=4)
    assert max(m["partial/staleness/max"] for m in straight) > 0  # stale tokens trained
    _run(tmp_path / "resumed", [*partial, "checkpoint.every=2"], steps=2)
    again = _run(tmp_path / "resumed", [*partial, "trainer.resume=auto"], steps=4)
    assert [m["step"] for m in again] == [1, 2, 3, 4]
    assert [_same(a, b) for a, b in zip(straight[2:], again[2:])] == [{}, {}]
    assert [a["partial/staleness/mean"] for a in straight[2:]] == [b["partial/staleness/mean"] for b in again[2:]]


@pytest.mark.numerics
def test_an_agent_job_at_max_staleness_zero_samples_what_the_synchronous_one_samples(tmp_path):
    """The same tokens, rewards and calls; logprobs and what follows from them within float noise:
    the synchronous endpoint batches calls by their arrival, the pool by rounds, and the HF engine's
    logprobs move by ~1e-7 with a batch's composition."""
    sync = _run(tmp_path / "sync", AGENT, steps=3)
    part = _run(tmp_path / "part", [*PARTIAL, *AGENT, "rollout.partial.max_staleness=0"], steps=3)
    exact = ("reward/", "response_length/", "agent/calls/", "agent/failures", "multi_turn/", "score/")
    for a, b in zip(sync, part):
        diff = _same(a, b)
        diff.pop("agent/requests_per_engine_call/mean", None)  # how calls were grouped, not what they drew
        assert not [k for k in diff if k.startswith(exact)], diff
        assert all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-6) for x, y in diff.values()), diff


@pytest.mark.numerics
def test_agent_episodes_wait_through_steps_and_score_as_sampled(tmp_path, caplog):
    """Agents in flight across steps: their calls wait on the endpoint while the step trains and go
    on after the sync, some cut inside a call; on frozen weights (lr 0) every model token's rollout
    logprob equals the trainer's on the rows as assembled, which are the template's one-shot
    rendering. A resume restarts the agent groups in flight from their prompts, in one line."""
    frozen = [*PARTIAL, *AGENT, "rollout.multi_turn.agent=tests.e2e.agents:one_to_four_calls", "roles.actor.lr=0.0"]
    _run(tmp_path / "run", [*frozen, "checkpoint.every=2"], steps=2)
    rows = _run(tmp_path / "run", [*frozen, "trainer.resume=auto"], steps=4)
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    assert any("agent group(s) in flight restart from their prompts" in r.getMessage() for r in caplog.records)
    assert max(m["partial/resumed_fraction"] for m in rows) > 0, "no agent episode spanned two versions"
    assert max(m["partial/staleness/max"] for m in rows) <= 2
    assert all(m["rollout_corr/logprob_abs_diff_max"] < 1e-5 for m in rows)
    assert all(m["multi_turn/token_mismatch_fraction"] == 0.0 and m["agent/calls/mean"] > 1.2 for m in rows)
    assert all(m["partial/in_flight_groups"] > 0 for m in rows)


@pytest.mark.parametrize(
    "override, key",
    [
        (
            ["rollout.multi_turn.agent=tests.e2e.agents:three_calls", "rollout.tensor_parallel_size=2"],
            "rollout.partial.enabled",
        ),
        (["algorithm.tis_cap=null"], "algorithm.tis_cap"),
    ],
)
def test_what_partial_rollouts_do_not_support_is_one_line_at_start(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*JOB, *PARTIAL, *override])
    assert any(line.startswith(key) for line in str(e.value).splitlines())
