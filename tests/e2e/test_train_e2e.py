"""End to end through the deepspeed launcher with 2 CPU ranks, gloo and a real vLLM engine."""

import glob
import math
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.helpers import (
    ROOT,
    assert_same_metrics,
    read_metrics,
    run_train,
    run_until_step,
    train_cmd,
    wandb_history,
)

pytestmark = pytest.mark.e2e
FAST = [
    "trainer.prompts_per_step=8",
    "rollout.n=8",
    "logging.sample_every=2",
    "roles.actor.micro_batch_size=16",
    "roles.actor.zero_stage=3",  # the ZeRO-3 gather into vLLM (the example picks auto -> 0 at this size)
    "rollout.engine=vllm",  # the example's auto picks HF generate for its 330k model on CPU
    "roles.critic.micro_batch_size=16",
    "roles.reference.micro_batch_size=16",
    "data.reward_fn=tests.e2e.helpers:length_reward",
    "trainer.val_every=0",
    "trainer.val_before_train=false",
    # pinned: the fp32 rollout-vs-trainer bound below must not follow the CPU kind (`auto`)
    *[f"precision.{k}_dtype=fp32" for k in ("actor", "critic", "reference", "rollout", "buffer")],
]
KEYS = [
    "reward/mean",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "response_length/mean",
    "timing_s/gen",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "perf/throughput",
    "precision/actor/loss_scale",
    "precision/actor/skipped_steps",
    "rollout_corr/logprob_abs_diff_mean",
    "rollout_corr/logprob_abs_diff_max",
    "rollout_corr/k3_kl",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_run(run_dir, steps, extra_keys=(), stale=False):
    """`stale`: partial rollouts train tokens of older weights: the rollout-vs-trainer gap then holds
    only on steps without them."""
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        for k in KEYS + list(extra_keys):
            assert k in r and r[k] is not None and math.isfinite(r[k]), (k, r.get(k))
    # the engine holds the actor's weights after every sync: in fp32 the rollout and the trainer agree
    for r in rows[1:]:
        if not (stale and r["partial/stale_token_fraction"] > 0):
            assert r["rollout_corr/logprob_abs_diff_max"] < 1e-3, r["rollout_corr/logprob_abs_diff_max"]
    hist = [h for h in wandb_history(run_dir) if "reward/mean" in str(h)]
    assert len(hist) >= steps, "W&B offline run lacks the step history"
    init = load_file(str(run_dir / "init_model" / "model.safetensors"))
    final = load_file(str(run_dir / "final_model" / "model.safetensors"))
    assert any(not torch.equal(init[k], final[k]) for k in final), "actor weights did not change"
    return rows


def test_grpo_three_steps(tmp_path):
    run_train("grpo_cpu_tiny.yaml", tmp_path, "trainer.steps=3", *FAST)
    _check_run(tmp_path, 3)
    assert (tmp_path / "reward_curve.png").stat().st_size > 0


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The example as shipped (rollout.engine: auto) for 3 steps: (its run dir, the launcher's output).
    Two tests read it: the engine it picks, and the plain optimizer the offloaded one is held against."""
    run_dir = tmp_path_factory.mktemp("quickstart")
    out = run_train("grpo_cpu_tiny.yaml", run_dir, "trainer.steps=3", *[o for o in FAST if o != "rollout.engine=vllm"])
    return run_dir, out


def test_quickstart_example_engine_auto_picks_hf_generate(quickstart):
    """The example as shipped (rollout.engine: auto): HF generate for its 330k model on CPU, 2 ranks."""
    run_dir, out = quickstart
    assert "rollout.engine auto -> hf" in out.stdout + out.stderr
    assert "memory allocator: tcmalloc" in out.stdout + out.stderr  # train.sh preloads it on CPU
    _check_run(run_dir, 3)


def test_ppo_gae_critic_three_steps(tmp_path):
    run_train("ppo_cpu_tiny.yaml", tmp_path, "trainer.steps=3", *FAST)
    _check_run(
        tmp_path,
        3,
        [
            "critic/vf_loss",
            "critic/vf_explained_var",
            "timing_s/values",
            "timing_s/update_critic",
            "precision/critic/loss_scale",
        ],
    )


def test_dapo_features_gspo_in_the_loop(tmp_path):
    """Dynamic sampling on the sparse arithmetic reward, overlong shaping, truncated samples masked,
    the GSPO loss, with partial rollouts (each round of dynamic sampling takes more groups from the
    pool) on one vLLM engine over both ranks (TP 2: each rank's pool, generated in lockstep): 3
    steps under the launcher."""
    fast = [o for o in FAST if not o.startswith("data.reward_fn")]
    run_train(
        "grpo_cpu_tiny.yaml",
        tmp_path,
        "trainer.steps=3",
        *fast,
        "algorithm.filter_groups.enabled=true",
        "algorithm.filter_groups.max_rounds=2",
        "algorithm.overlong.buffer_len=1",
        "algorithm.mask_truncated=true",
        "algorithm.policy_loss=gspo",
        "rollout.partial.enabled=true",
        "rollout.partial.chunk_tokens=2",
        "algorithm.tis_cap=2.0",
        "rollout.tensor_parallel_size=2",
    )
    rows = _check_run(
        tmp_path,
        3,
        [
            "partial/staleness/max",
            "filter/kept_groups",
            "filter/rounds",
            "filter/zero_variance_fraction",
            "response/truncated_fraction",
            "filter/reward_mean_drawn",
        ],
    )
    for r in rows:  # an untrained model mostly fails every sample: most groups carry no gradient
        assert r["filter/rounds"] >= 1 and r["filter/kept_groups"] <= 8 and r["filter/zero_variance_fraction"] > 0
        assert r["partial/staleness/max"] <= 1  # rollout.partial.max_staleness
        assert r["partial/rounds"] >= 2  # chunked rounds, each one engine call for the whole TP group


def test_cispo_with_fp32_lm_head_in_bf16(tmp_path):
    """CISPO loss and the fp32 LM head with a bf16 actor and reference (the rollout stays fp32 and gets
    vLLM's fp32-head override: a bf16 vLLM on an AVX2-only CPU is emulated and slow)."""
    bf16 = [f"precision.{k}_dtype=bf16" for k in ("actor", "reference")] + ["precision.rollout_dtype=fp32"]
    run_train(
        "grpo_cpu_tiny.yaml",
        tmp_path,
        "trainer.steps=2",
        *FAST,
        *bf16,
        "precision.lm_head_fp32=true",
        "algorithm.policy_loss=cispo",
    )
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["actor/pg_loss"]) and r["rollout_corr/logprob_abs_diff_max"] < 0.5


def test_validation_before_and_every_k_steps(tmp_path):
    """Held-out arithmetic prompts, validated at step 0 and every 2 steps on the rollout engine."""
    fast = [o for o in FAST if not o.startswith(("trainer.val", "data.reward_fn"))]
    run_train(
        "grpo_cpu_tiny.yaml",
        tmp_path,
        "trainer.steps=4",
        *fast,
        "data.val_fraction=0.2",
        "trainer.val_every=2",
        "trainer.val_n=4",
    )
    rows = read_metrics(tmp_path)
    val = {r["step"]: r for r in rows if "val/arithmetic/accuracy" in r}
    assert sorted(val) == [0, 2, 4]
    for r in val.values():
        for key in (
            "val/arithmetic/accuracy",
            "val/arithmetic/mean@4",
            "val/arithmetic/pass@4",
            "val/response_length/mean",
        ):
            assert 0 <= r[key] <= 3 and math.isfinite(r[key])
        assert r["val/arithmetic/pass@4"] >= r["val/arithmetic/mean@4"]


def test_lora_zero3_two_ranks_sync(tmp_path):
    """A LoRA actor at ZeRO-3 on 2 ranks with vLLM: merged weights reach the engine every step. (kill
    -9 + resume of a LoRA actor at ZeRO-3 on vLLM: the multi-turn test below.)"""
    lora = ["model.lora.rank=8", "roles.actor.lr=0.01", "trainer.steps=4"]
    ref = tmp_path / "ref"
    run_train("grpo_cpu_tiny.yaml", ref, *FAST, *lora)
    rows = _check_run(ref, 4)
    for r in rows:
        assert r["rollout_corr/logprob_abs_diff_max"] <= 1e-5, r["rollout_corr/logprob_abs_diff_max"]
    assert rows[-1]["actor/kl_ref"] > 0  # the adapters moved the policy off the base


def _kill_at_3_then_resume_reproduces(tmp_path, config, overrides, rows, keys):
    """kill -9 once step 3 is logged, keep the checkpoints up to step 2 (as if the kill landed before
    step 4's), resume: auto to step 4: steps 3-4 equal the uninterrupted run's `rows[2:]` on `keys`
    (None: on every value but the timings, bitwise); and what the kill left in /dev/shm is removed by
    that next start, a live job's buffer kept."""
    killed, port = tmp_path / "killed", str(_free_port())
    run_until_step(config, killed, 3, *overrides, "trainer.steps=50", "checkpoint.every=2", MASTER_PORT=port)
    assert not list((killed / "checkpoints").glob(".*.tmp"))  # the kill left no half-written checkpoint
    for late in (killed / "checkpoints").glob("step_*"):
        if int(late.name.split("_")[1]) > 2:
            shutil.rmtree(late)
    # the killed job's /dev/shm all-reduce buffers (no exit handler ran) go at the next start, while a
    # live job's buffer beside them stays
    left = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*")
    assert len(left) == 2, left  # one per rank: what the kill leaves
    live = f"/dev/shm/deepspeed_allreduce_buffer_0_127.0.0.1_{port}live_0"
    with (
        open(live, "wb") as f,
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=f) as job,
    ):
        try:  # a live process holding its buffer open: a job running beside the next start
            out = run_train(config, killed, *overrides, "trainer.resume=auto", "checkpoint.every=2")
            assert not any(os.path.exists(b) for b in left), left
            assert os.path.exists(live)
            assert "DeepSpeed shm buffer(s) of jobs that are gone" in out.stdout + out.stderr
        finally:
            job.kill()
            if os.path.exists(live):
                os.remove(live)
    # the killed run's own steps after the checkpoint are replaced, not duplicated
    resumed = [r for r in read_metrics(killed) if r["step"] >= 3]
    assert [r["step"] for r in resumed] == [3, 4]
    if keys is None:
        assert_same_metrics(rows[2:], resumed, "resumed from step 2")
        return
    for got, want in zip(resumed, rows[2:]):
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (key, got[key], want[key])


def test_a_user_mistake_exits_2_with_one_line_through_the_launcher(tmp_path):
    """launch/train.sh's launcher hands a rank's exit code back (2 for a user mistake), the error is
    one line naming the key, and nothing is left of the run (no traceback, no checkpoint)."""
    cmd, env = train_cmd("grpo_cpu_tiny.yaml", tmp_path / "run", "trainer.no_such_key=1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "error: trainer.no_such_key: unknown key" in out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_multi_turn_zero3_vllm_lora_filter_groups_partial_kill_resume(tmp_path):
    """The retry environment on 2 ranks under the launcher (ZeRO-3, vLLM, a LoRA actor, dynamic
    sampling, partial rollouts): episodes run several turns with environment tokens in the rows and
    some stay in flight across steps; the trainer's logprobs match vLLM's on the model's tokens
    where no token is stale, and kill -9 + resume: auto (episodes in flight in the checkpoint)
    reproduces steps 3-4."""
    mt = [
        "model.lora.rank=8",
        "roles.actor.lr=0.01",
        "trainer.steps=4",
        "algorithm.filter_groups.enabled=true",
        "algorithm.filter_groups.max_rounds=2",
        "rollout.partial.enabled=true",
        "rollout.partial.chunk_tokens=2",  # episodes pause mid-turn and between turns
        "rollout.partial.tail_fraction=1.0",  # cut the moment a step can train
        "rollout.max_new_tokens=16",  # turns end at random lengths (eos)...
        "rollout.n=2",  # ...and groups of 2 at different rounds (8 episodes nearly always hold a longest one)
        "roles.actor.micro_batch_size=8",
        "algorithm.tis_cap=2.0",
    ]
    ref = tmp_path / "ref"
    run_train("grpo_cpu_tiny_retry.yaml", ref, *FAST, *mt)
    rows = _check_run(ref, 4, ["multi_turn/turns/mean", "response/env_tokens/mean", "filter/kept_groups"], stale=True)
    for r in rows:
        assert r["multi_turn/turns/mean"] > 1.5 and r["multi_turn/turns/max"] == 3.0
        assert r["response/env_tokens/mean"] > 0.5 and r["multi_turn/token_mismatch_fraction"] == 0.0
        if r["partial/stale_token_fraction"] == 0:  # every token sampled by the weights that score it
            assert r["rollout_corr/logprob_abs_diff_max"] <= 1e-5, r["rollout_corr/logprob_abs_diff_max"]
    assert rows[0]["partial/stale_token_fraction"] == 0 and max(r["partial/staleness/max"] for r in rows) == 1
    assert max(r["partial/resumed_fraction"] for r in rows) > 0  # episodes paused and went on, on new weights
    _kill_at_3_then_resume_reproduces(
        tmp_path,
        "grpo_cpu_tiny_retry.yaml",
        [*FAST, *mt],
        rows,
        ("reward/mean", "actor/pg_loss", "multi_turn/turns/mean", "response/env_tokens/mean", "data/position"),
    )


def test_single_turn_partial_kill_resume_is_bitwise(tmp_path):
    """Single-turn partial rollouts on 2 ranks under the launcher with vLLM: the checkpoint at step 2
    holds groups in flight (paused mid-answer, tokens of an older version), and kill -9 + resume: auto
    reproduces steps 3-4 of the uninterrupted run bitwise, the partial/* values included."""
    part = [
        *FAST,
        "rollout.partial.enabled=true",
        "rollout.partial.chunk_tokens=2",
        "rollout.partial.tail_fraction=1.0",  # cut the moment a step can train
        "rollout.partial.max_staleness=2",
        "rollout.partial.over_provision=2.0",
        "rollout.n=2",  # groups of 2 end at different times (eos at random lengths)
        "rollout.max_new_tokens=16",
        "roles.actor.micro_batch_size=8",
        "algorithm.tis_cap=2.0",
        "trainer.steps=4",
    ]
    ref = tmp_path / "ref"
    run_train("grpo_cpu_tiny.yaml", ref, *part)
    rows = read_metrics(ref)
    assert rows[1]["partial/in_flight_groups"] > 0  # what the step-2 checkpoint must carry
    assert max(r["partial/resumed_fraction"] for r in rows[2:]) > 0 and rows[2]["partial/staleness/max"] > 0
    _kill_at_3_then_resume_reproduces(tmp_path, "grpo_cpu_tiny.yaml", part, rows, None)


def test_partial_multi_turn_under_tensor_parallelism_at_zero_staleness_is_the_synchronous_run(tmp_path):
    """The retry environment with partial rollouts on one vLLM engine over 2 ranks (TP 2): each rank
    keeps its own pool and the group generates in lockstep (a round runs while any member cannot
    train yet). With max_staleness 0 the run is the synchronous TP-2 run bitwise (staleness 1 under
    TP: the DAPO test)."""
    mt = [
        "rollout.tensor_parallel_size=2",
        "trainer.steps=2",
        "rollout.max_new_tokens=8",
        "rollout.n=2",
        "roles.actor.micro_batch_size=8",
        "algorithm.tis_cap=2.0",
    ]
    partial = ["rollout.partial.enabled=true", "rollout.partial.chunk_tokens=2", "rollout.partial.max_staleness=0"]
    run_train("grpo_cpu_tiny_retry.yaml", tmp_path / "sync", *FAST, *mt)
    run_train("grpo_cpu_tiny_retry.yaml", tmp_path / "zero", *FAST, *mt, *partial)
    skip = ("timing_s/", "perf/", "memory/", "partial/")
    differ = [
        {k for k in a.keys() | b.keys() if not k.startswith(skip) and a.get(k) != b.get(k)}
        for a, b in zip(read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "zero"))
    ]
    assert differ == [set(), set()], differ
    assert read_metrics(tmp_path / "zero")[0]["multi_turn/turns/mean"] > 1.0


@pytest.mark.parametrize("tp", [1, 2])
def test_an_openai_client_agent_trains_under_the_launcher(tmp_path, tp):
    """`rollout.multi_turn.agent`: an agent written with the real `openai.AsyncOpenAI` client (three
    calls, each offering a tool) trains 3 steps on 2 ranks (vLLM, ZeRO-3), each rank serving its own
    endpoint (tp 1), or one vLLM engine over both ranks (tp 2: the first rank runs both ranks' agents
    on its endpoint, the other takes part in its engine calls and gets its own examples' episodes).
    Its rows are the template's one-shot rendering of the conversations, the trainer's logprobs on
    the model's tokens equal the engine's, the tool/user turns are environment tokens; agents that
    edit history fork and agents that raise are counted while the run goes on."""
    agent = [
        f"rollout.tensor_parallel_size={tp}",
        "model.tiny.tokenizer=chat",
        "data.apply_chat_template=true",
        "data.reward_fn=none",
        "rollout.multi_turn.agent=tests.e2e.agents:three_calls",
        "rollout.max_new_tokens=4",
        "trainer.steps=3",
        "data.val_fraction=0.2",
        "trainer.val_every=3",
        "trainer.val_n=2",
    ]
    run = tmp_path / "run"
    out = run_train("grpo_cpu_tiny.yaml", run, *FAST, *agent)
    assert "built successfully" not in out.stdout + out.stderr  # DeepSpeed's op-build print stays off the console
    rows = _check_run(run, 3, ["agent/calls/mean", "agent/failures", "multi_turn/forks"])
    for r in rows:
        assert r["multi_turn/token_mismatch_fraction"] == 0.0
        assert r["rollout_corr/logprob_abs_diff_max"] <= 1e-5, r["rollout_corr/logprob_abs_diff_max"]
        assert r["response/env_tokens/mean"] > 10  # each later call's new turns
        assert 1.0 <= r["agent/calls/mean"] <= 3.0
    assert sum(r["agent/failures"] for r in rows) > 0 and sum(r["multi_turn/forks"] for r in rows) > 0
    assert all(r["agent/calls/mean"] > 2.0 for r in rows), "most agents make their three calls"
    assert rows[-1]["val/agent/calls/mean"] > 1.0


@pytest.mark.numerics
def test_fp16_end_to_end_runs_with_loss_scaling_and_matched_dtypes_keep_the_rollout_gap_small(tmp_path, capsys):
    """The actor, the reference and the rollout all in fp16 (dynamic loss scaling, fp32 masters), 3
    steps under the launcher; the same job with an fp32 trainer and a bf16 rollout (the mismatched
    pair behind "phantom clipping"), and all in bf16. ATen's own 16-bit kernels
    (`precision.cpu_gemm=native`): under `cpu_gemm: fp32` the HF rollout and the trainer run the same
    fp32 products and round alike, so the gap would not show the format at all.

    What holds on every CPU kind, and so what is asserted: loss scaling ran in fp16 (and not in
    bf16); each gap is within bounds derived from its own format's unit roundoff (the mismatched
    pair above a fraction of bf16's, each matched pair under half its own). Which matched format is
    closer is NOT asserted, nor is any gap compared with another: it depends on the kernels. With
    two kernel paths (AVX2: bf16 emulated) fp16 is the closer; on an avx512_bf16 CPU both sides of
    a matched pair run the same native kernel and both gaps are ~5e-8, their order noise
    (docs/ARCHITECTURE.md, Tests). The comparison is printed, as
    `bench precision --matrix` reports it."""
    runs = {}
    for name, (trainer, rollout) in {
        "fp16": ("fp16", "fp16"),
        "fp32/bf16": ("fp32", "bf16"),
        "bf16": ("bf16", "bf16"),
    }.items():
        run_dir = tmp_path / name.replace("/", "_")
        run_train(
            "grpo_cpu_tiny.yaml",
            run_dir,
            "trainer.steps=3",
            "trainer.prompts_per_step=8",
            "rollout.n=8",
            "roles.actor.micro_batch_size=16",
            "roles.reference.micro_batch_size=16",
            "rollout.engine=hf",
            "trainer.val_every=0",
            "trainer.val_before_train=false",
            *[f"precision.{k}_dtype={trainer}" for k in ("actor", "reference")],
            f"precision.rollout_dtype={rollout}",
            "precision.buffer_dtype=fp32",
            "precision.cpu_gemm=native",
        )
        runs[name] = read_metrics(run_dir)
    fp16 = runs["fp16"]
    assert [r["step"] for r in fp16] == [1, 2, 3]
    assert all(r["precision/actor/loss_scale"] > 1 for r in fp16)  # dynamic loss scaling ran
    assert all(r["precision/actor/loss_scale"] == 1.0 for r in runs["bf16"])
    gap = {n: sum(r["rollout_corr/logprob_abs_diff_mean"] for r in rows) / 3 for n, rows in runs.items()}
    with capsys.disabled():
        order = "fp16 closer" if gap["fp16"] < gap["bf16"] else "bf16 closer"
        print(f"\nmean rollout-vs-trainer |dlogprob| over 3 steps: {gap} (measured, not asserted: {order})")
    # A rounding of the rollout's logits alone moves a logprob by a fraction of the format's unit
    # roundoff u (fp32 trainer vs bf16 rollout: ~0.3 u_bf16 on both CPU kinds); a matched pair rounds
    # alike, so its gap stays under half its own u whatever the kernels (measured 1e-4..0.1 u).
    u = {"fp16": 2.0**-11, "bf16": 2.0**-8}
    assert u["bf16"] / 16 < gap["fp32/bf16"] < u["bf16"], gap  # the mismatched pair shows bf16's rounding
    for fmt in ("fp16", "bf16"):
        assert gap[fmt] < u[fmt] / 2, (fmt, gap)  # matched: each under its own format's bound
    assert all(0 <= r["rollout_corr/phantom_clip_fraction"] <= 1 for rows in runs.values() for r in rows)


@pytest.mark.numerics
def test_a_matched_bf16_pair_is_exact_where_the_kernels_allow(tmp_path):
    """bf16 trainer + bf16 HF rollout, `attn_implementation: auto` (`sdpa_cpu16`): the trainer's forward
    under grad is SDPA's, the rollout's kernel (the math only for its backward), so on a CPU with bf16
    kernels (avx512_bf16/AMX, `cpu_gemm: auto` -> native) the first epoch's logprobs are the rollout's,
    bitwise. On an AVX2 CPU (`auto` -> fp32 products rounded once; under forced AVX2 kernels the same
    setting stands in for it) the one-token decode and the full sequence still take different kernel
    paths (a token's logprob up to 3e-4 apart, measured): the mean gap is bounded there by a sixteenth of
    bf16's unit roundoff."""
    from verl_ds.precision import detect_hardware

    forced = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2"
    native = detect_hardware("cpu").cpu_bf16 and not forced
    run_dir = tmp_path / "run"
    run_train(
        "grpo_cpu_tiny.yaml",
        run_dir,
        "trainer.steps=2",
        "rollout.engine=hf",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        "precision.actor_dtype=bf16",
        "precision.reference_dtype=bf16",
        "precision.rollout_dtype=bf16",
        f"precision.cpu_gemm={'native' if native else 'fp32'}",
        ranks=1,
    )
    rows = read_metrics(run_dir)
    assert len(rows) == 2
    if native:
        assert [r["rollout_corr/logprob_abs_diff_max"] for r in rows] == [0.0, 0.0], rows
    else:
        assert max(r["rollout_corr/logprob_abs_diff_mean"] for r in rows) < 2.0**-8 / 16, rows


def test_distillation_with_an_int8_and_a_bf16_teacher_under_the_launcher(tmp_path, capsys):
    """On-policy distillation on 2 ranks with a ZeRO-3 student and vLLM: the teacher in int8
    (weight-only, ZeRO-0) and in bf16 (ZeRO-3). The first step's samples are the same in both runs
    (same seed, same student), so their reverse KLs differ only by the teacher's precision: close,
    and not equal."""
    from tests.trainer.test_distill import sharp_teacher

    teacher = sharp_teacher(tmp_path / "teacher", hidden=128, layers=2, heads=4, ffn=256)  # the example's shape
    first = {}
    for dtype, ds in (("int8", "teacher_zero0.json"), ("bf16", "teacher_zero3.json")):
        run_dir = tmp_path / dtype
        out = run_train(
            "grpo_cpu_tiny.yaml",
            run_dir,
            "trainer.steps=2",
            *[o for o in FAST if "reference" not in o],
            "algorithm.kl_coef=0",
            f"model.teacher_path={teacher}",
            "algorithm.distill.coef=1.0",
            f"precision.teacher_dtype={dtype}",
            f"roles.teacher.ds_config={ds}",
            "roles.teacher.micro_batch_size=16",
        )
        rows = read_metrics(run_dir)
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            for k in ("distill/reverse_kl/mean", "distill/teacher_logprob/mean", "timing_s/teacher"):
                assert math.isfinite(r[k]), (dtype, k, r.get(k))
        assert ("int8 teacher:" in out.stdout + out.stderr) == (dtype == "int8")
        first[dtype] = rows[0]["distill/reverse_kl/mean"]
    with capsys.disabled():
        print(f"\nstep-1 reverse KL to the teacher by its dtype: {first}")
    assert first["int8"] > 0.5, first  # the sharp teacher is far from the random student
    assert first["int8"] != first["bf16"] and abs(first["int8"] - first["bf16"]) < 0.05 * first["bf16"], first


@pytest.mark.numerics
def test_an_offloaded_optimizer_trains_like_the_plain_one_and_resumes_from_its_checkpoint(tmp_path, capsys, quickstart):
    """roles.actor.offload=optimizer under the launcher (ZeRO-3, DeepSpeedCPUAdam on the host): the
    same seed gives the same reward curve as the plain optimizer (every sample alike) and every other
    metric within 1e-5 relative (DeepSpeedCPUAdam's arithmetic is not torch's fused AdamW's: measured
    ~1e-7); `resume: auto` from the step-2 checkpoint (its host-side Adam states) gives step 3 again.
    (kill -9 itself: test_kill_after_step_2_then_resume_auto and the multi-turn and LoRA runs.)"""
    plain, off = quickstart[0], tmp_path / "offload"  # the plain run: the example's engine auto -> hf
    extra = ("checkpoint.every=2", "roles.actor.offload=optimizer", "rollout.engine=hf")
    run_train("grpo_cpu_tiny.yaml", off, "trainer.steps=3", *FAST, *extra)
    a, b = read_metrics(plain), read_metrics(off)
    assert [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b]
    worst = 0.0
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/kl_ref"):
        scale = max(abs(r[k]) for r in a)  # relative to the metric's own size over the run
        worst = max(worst, max(abs(ra[k] - rb[k]) for ra, rb in zip(a, b)) / max(scale, 1e-12))
    with capsys.disabled():
        print(f"\noffloaded vs plain optimizer over 3 steps: reward curve equal, worst relative metric gap {worst:.2e}")
    assert worst < 1e-5, worst

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(off / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    run_train("grpo_cpu_tiny.yaml", resumed, "trainer.steps=3", "trainer.resume=auto", *FAST, *extra)
    (again,) = [r for r in read_metrics(resumed) if "reward/mean" in r]
    assert again["step"] == 3
    for key in ("reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert again[key] == pytest.approx(b[2][key], rel=1e-6, abs=1e-9), (key, again[key], b[2][key])
