"""Memory diagnostics: analytic estimate vs real DeepSpeed tensors, per-stage trainer metrics,
the Markdown compare, the will-it-fit verdict for an 8B Llama, and the autocast warning."""

import json
import warnings
from pathlib import Path

import pytest
import torch

from tests.diagnostics.helpers import LLAMA_8B, parse_md_tables, tiny_overrides, write_yaml
from verl_ds import cli
from verl_ds.config import load_config
from verl_ds.diagnostics import memory as M
from verl_ds.ds_config import render_ds_configs, run_precision
from verl_ds.roles.batch import TrainBatch


@pytest.fixture(scope="module")
def ppo_step(tmp_path_factory):
    """One PPO step (actor ZeRO-3, critic ZeRO-2, reference ZeRO-0, all fp32) with activation tracking."""
    from verl_ds.trainer.rl_trainer import RLTrainer

    cfg = load_config(None, tiny_overrides(tmp_path_factory.mktemp("ppo")) + ["algorithm.estimator=gae"])
    with RLTrainer(cfg) as trainer:
        trainer.track_activations = True
        metrics = trainer.step()
        yield cfg, trainer, metrics


def test_estimate_matches_tensor_bytes(ppo_step):
    cfg, trainer, metrics = ppo_step
    shape = M.ModelShape.from_hf_config(json.loads(Path(trainer.model_path, "config.json").read_text()))
    assert shape.params("lm") == sum(p.numel() for p in trainer.reference.module.parameters())
    est = M.estimate_memory(cfg, shape, render_ds_configs(cfg, 1), 1, run_precision(cfg).rollout)["update"]
    measured = M.stages_from_metrics(metrics)["update"]
    for role, comps in {
        "actor": ("weights_fp32", "master", "grads", "optimizer"),
        "critic": ("weights_fp32", "master", "grads", "optimizer"),
        "reference": ("weights_fp32",),
    }.items():
        for c in comps:
            e, m = est[role][c], measured[role][c]
            assert abs(e - m) <= 0.05 * m, f"{role}/{c}: estimate {e} vs measured {m}"
    assert measured["actor"]["activations"] > 0  # saved-for-backward peak was tracked


def test_trainer_step_logs_memory_per_stage(ppo_step):
    _, _, metrics = ppo_step
    for key in (
        "memory/rollout/rollout/weights_fp32_mib",
        "memory/score/reference/weights_fp32_mib",
        "memory/update/actor/optimizer_mib",
        "memory/update/critic/grads_mib",
        "memory/sync/actor/total_mib",
        "memory/update/process/rss_mib",
    ):
        assert metrics.get(key, 0) > 0, key
    assert any(k.startswith("precision/actor/") for k in metrics)


def test_autocast_warning_fires_once(ppo_step, monkeypatch):
    from verl_ds.roles import base

    _, trainer, _ = ppo_step
    ids = torch.randint(4, 20, (2, 6))
    batch = TrainBatch(ids, torch.ones_like(ids), torch.ones(2, 2))
    monkeypatch.setattr(base, "_AUTOCAST_WARNED", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.reference.logprobs(batch)  # no autocast: silent
        with torch.autocast("cpu", dtype=torch.bfloat16):
            trainer.reference.logprobs(batch)
            trainer.actor.logprobs(batch)
    assert sum(issubclass(w.category, base.AutocastWarning) for w in seen) == 1


def test_compare_fp16_vs_fp32_is_markdown_and_halves_weights(tmp_path, capsys):
    base = {
        "model": {"path": "tiny", "tiny": {"hidden": 32, "ffn": 64}},
        "rollout": {"engine": "hf"},
        "trainer": {"run_dir": str(tmp_path / "run")},
    }
    a = write_yaml(tmp_path / "fp32.yaml", {**base, "precision": {"actor_dtype": "fp32", "reference_dtype": "fp32"}})
    b = write_yaml(tmp_path / "fp16.yaml", {**base, "precision": {"actor_dtype": "fp16", "reference_dtype": "fp16"}})
    assert cli.main(["debug", "memory", "--compare", a, b, "--metric", "peak_memory"]) == 0
    (table,) = parse_md_tables(capsys.readouterr().out)
    assert table[0] == ["role", "component", "fp32", "fp16", "delta", "ratio"]
    rows = {(r[0], r[1]): r for r in table[1:]}
    for role in ("actor", "reference"):
        assert rows[(role, "weights (fp32 → fp16)")][5] == "0.50"
    assert rows[("actor", "optimizer")][5] == "1.00"  # fp32 Adam states either way


def test_debug_memory_measured_report_is_markdown(tmp_path, capsys):
    cfg = write_yaml(tmp_path / "c.yaml", {"rollout": {"engine": "hf"}})
    assert cli.main(["debug", "memory", "--config", cfg, "--stage", "train"] + tiny_overrides(tmp_path / "r")) == 0
    out = capsys.readouterr().out
    tables = parse_md_tables(out)
    assert len(tables) == 2 and "### stage: update" in out and "### stage: sync" in out
    rows = {(r[0], r[1]): r for r in tables[0][1:]}
    assert rows[("actor", "optimizer")][3] != "n/a"  # measured column filled


def _debug_memory_8b(*extra: str) -> int:
    """`verl-ds debug memory` on the tiny example's run config for Llama-3-8B's shape, on 80 GB GPUs."""
    args = ["debug", "memory", "--config", "examples/grpo_cpu_tiny.yaml", "--model-config", str(LLAMA_8B)]
    return cli.main([*args, "--gpu-memory-gb", "80", *extra])


@pytest.mark.parametrize("world,fits", [(1, False), (8, True)])
def test_llama8b_zero3_verdict(world, fits, capsys):
    assert M.load_shape(str(LLAMA_8B)).params() == 8_030_261_248
    args = [
        "--world-size",
        str(world),
        "precision.actor_dtype=bf16",
        "precision.reference_dtype=bf16",
        "precision.rollout_dtype=bf16",
        "roles.reference.ds_config=ref_zero3.json",
        "precision.enable_grad_checkpointing=true",
        "roles.actor.micro_batch_size=4",
        "roles.reference.micro_batch_size=4",
        "data.max_prompt_length=512",
        "rollout.max_new_tokens=512",
        "rollout.max_model_len=1024",
    ]
    assert _debug_memory_8b(*args) == 0
    out = capsys.readouterr().out
    assert ("**Verdict: fits**" in out) == fits and "n/a" in out
    parse_md_tables(out)


def test_missing_model_config_is_a_user_error(capsys):
    assert (
        cli.main(["debug", "memory", "--config", "examples/grpo_cpu_tiny.yaml", "--model-config", "nope/config.json"])
        == 2
    )
    assert "error: --model-config" in capsys.readouterr().err


def test_zero_stage_auto_picks_the_lowest_stage_that_fits():
    overrides = [
        "roles.actor.zero_stage=auto",
        "roles.reference.zero_stage=auto",
        "rollout.max_model_len=1024",
        "data.max_prompt_length=256",
        "roles.actor.micro_batch_size=4",
        "roles.reference.micro_batch_size=4",
        "precision.actor_dtype=bf16",
        "precision.reference_dtype=bf16",
    ]
    cfg = load_config("examples/grpo_cpu_tiny.yaml", overrides)
    shape = M.load_shape(str(LLAMA_8B))
    ds = render_ds_configs(cfg, 8)
    roomy = M.choose_zero_stages(cfg, shape, ds, 8, 1e15, ["actor", "reference"])
    tight = M.choose_zero_stages(cfg, shape, ds, 8, 80 * 2**30, ["actor", "reference"])
    hopeless = M.choose_zero_stages(cfg, shape, ds, 8, 2**30, ["actor", "reference"])
    assert roomy == {"actor": 0, "reference": 0}
    assert tight["actor"] >= 1  # an 8B model on 80 GB needs sharding
    assert hopeless == {"actor": 3, "reference": 3}  # nothing fits: ZeRO-3
    rendered = render_ds_configs(cfg, 8, zero_stages=tight)
    assert rendered["actor"]["zero_optimization"]["stage"] == tight["actor"]
    # a sleeping actor needs a ZeRO optimizer (stage >= 1): auto never picks 0 for it, even when 0 fits
    asleep = load_config("examples/grpo_cpu_tiny.yaml", [*overrides, "roles.actor.sleep=true"])
    assert M.choose_zero_stages(asleep, shape, ds, 8, 1e15, ["actor", "reference"]) == {"actor": 1, "reference": 0}


def test_bench_step_prints_phases_and_floor(tmp_path, capsys):
    assert (
        cli.main(
            [
                "bench",
                "step",
                "--config",
                "examples/grpo_cpu_tiny.yaml",
                "--steps",
                "1",
                "rollout.engine=hf",
                "trainer.prompts_per_step=4",
                "rollout.n=4",
                "model.tiny.hidden=32",
                "model.tiny.ffn=64",
                f"trainer.run_dir={tmp_path}",
                "roles.actor.micro_batch_size=16",
                "roles.reference.micro_batch_size=16",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    tables = parse_md_tables(out)
    phases = {row[0] for row in tables[0][1:]}
    assert {"update_actor", "gen", "**step**"} <= phases
    floor = {row[0]: row[4] for row in tables[0][1:]}  # the floor's own phases, same names
    assert all(float(floor[k]) > 0 for k in ("gen", "update_actor", "ref", "**step**")), floor
    padding = {row[0]: row[3] for row in tables[0][1:]}  # real / run tokens of the phase's role pass
    assert all(0 < float(padding[k]) <= 1 for k in ("update_actor", "ref")), padding
    assert "verl-ds / floor =" in out and "training MFU" in out


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_a_teacher_larger_than_the_student_is_estimated_with_its_own_shape(tmp_path, dtype):
    """The teacher's weights, estimated from its own config.json (`role_shapes`: a teacher is often
    larger than the student), match what its engine holds in a real step, fp32 and int8."""
    from verl_ds.data.tiny import build_tiny_llama
    from verl_ds.trainer.rl_trainer import RLTrainer

    teacher = build_tiny_llama(tmp_path / "teacher", hidden=96, layers=3, heads=2, ffn=192)
    overrides = tiny_overrides(tmp_path / "run") + [
        f"model.teacher_path={teacher}",
        "algorithm.distill.coef=1",
        f"precision.teacher_dtype={dtype}",
        "model.tiny.heads=2",
    ]
    cfg = load_config(None, overrides)
    with RLTrainer(cfg) as trainer:
        measured = M.stages_from_metrics(trainer.step())["score"]["teacher"]
        student = M.ModelShape.from_hf_config(json.loads(Path(trainer.model_path, "config.json").read_text()))
    shapes = M.role_shapes(cfg)
    assert shapes["teacher"].params("lm") > 4 * student.params("lm")
    est = M.estimate_memory(cfg, student, render_ds_configs(cfg, 1), 1, "fp32", role_shapes=shapes)["score"]["teacher"]
    key = "weights_int8" if dtype == "int8" else "weights_fp32"
    assert abs(est[key] - measured[key]) <= 0.1 * measured[key], (est, measured)


# DeepSpeed's own model-state estimators (per GPU, and host per node), for the 8B shape
def _ours(cfg_overrides, world):
    cfg = load_config(None, cfg_overrides + ["model.tiny.hidden=32"])
    shape = M.load_shape(str(LLAMA_8B))
    ds = render_ds_configs(cfg, world, run_precision(cfg))["actor"]
    st = M.model_states(shape, ds, head="lm", trainable=True, world=world)
    device = sum(st["device"].values())  # grads_update / grads_fp32_update included: DeepSpeed counts them too
    return shape, device, sum(st["host"].values())


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("offload", ["none", "optimizer", "optimizer+params"])
def test_zero3_model_states_match_deepspeeds_estimator(world, offload):
    """ZeRO-3, bf16, Llama-3-8B: device and host bytes per rank against
    `estimate_zero3_model_states_mem_needs` (zero_init, additional_buffer_factor 1; its largest-layer
    term, a gather buffer, is ours' `other`, outside model states). Equal, except without offload,
    where DeepSpeed's 18 bytes/param leave out the persistent 16-bit gradient partition ZeRO-3 keeps
    (measured by `test_estimate_matches_tensor_bytes`): ours is 20/18 of it."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    ov = ["precision.actor_dtype=bf16", "roles.actor.zero_stage=3", f"roles.actor.offload={offload}"]
    shape, device, host = _ours(ov, world)
    psi = shape.params("lm")
    nodes, per_node = (world // 8, 8) if world > 8 else (1, world)
    cpu, gpu, largest = estimate_zero3_model_states_mem_needs(
        psi, shape.largest_module(), per_node, nodes, offload != "none", "params" in offload, True, 1.0
    )
    want_device = gpu - largest
    if offload == "none":
        assert device == pytest.approx(want_device * 20 / 18, rel=1e-6)
        assert host == 0
    else:
        assert device == pytest.approx(want_device, rel=1e-6, abs=1.0)
        assert host == pytest.approx(cpu / per_node, rel=1e-6)  # DeepSpeed's host bytes are per node


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_zero2_model_states_match_deepspeeds_estimator(world, offload):
    """ZeRO-2, bf16, Llama-3-8B, one node: `estimate_zero2_model_states_mem_needs` per GPU (and, with
    offload, host per node; its 4 bytes/param per process for loading fp32 weights is outside model
    states, so the comparison stops at 4 ranks, where its 16 bytes/param term still dominates)."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    ov = ["precision.actor_dtype=bf16", "roles.actor.zero_stage=2", f"roles.actor.offload={offload}"]
    shape, device, host = _ours(ov, world)
    cpu, gpu = estimate_zero2_model_states_mem_needs(shape.params("lm"), world, 1, offload != "none", 1.0)
    if offload == "none":
        assert device == pytest.approx(gpu, rel=1e-6)
        assert host == 0
    else:  # DeepSpeed counts the 16-bit weights only; the 16-bit gradients backward makes are ours too
        assert device - 2 * shape.params("lm") / world == pytest.approx(gpu, rel=1e-6)
        assert host * world == pytest.approx(cpu, rel=1e-6)


def test_debug_memory_prints_the_host_share_of_an_offloaded_optimizer(capsys):
    args = ["debug", "memory", "--config", "examples/grpo_cpu_tiny.yaml", "--model-config", str(LLAMA_8B)]
    extra = ["--world-size", "8", "roles.actor.offload=optimizer", "precision.actor_dtype=bf16"]
    assert cli.main(args + extra) == 0
    out = capsys.readouterr().out
    # 8.03B params / 8 ranks: fp32 masters 4 B, Adam 8 B, fp32 gradients 4 B per parameter
    assert "Host memory per rank (offloaded): actor: master 3.74 GiB + optimizer 7.48 GiB + grads 3.74 GiB." in out
    update = parse_md_tables(out.split("### stage: update", 1)[1])[0]
    assert not [r for r in update if r[0] == "actor" and r[1] in ("master", "optimizer")]  # not on the GPU


def test_sequence_parallel_splits_a_rows_activations_and_adds_the_all_to_all_buffers():
    from verl_ds.diagnostics.memory.estimate import pass_memory

    shape = M.load_shape(str(LLAMA_8B))
    kw = dict(head="lm", grad=True, grad_checkpointing=True)
    one = pass_memory(shape, "bf16", 1, 65536, 4096, **kw)
    two = pass_memory(shape, "bf16", 1, 65536, 4096, **kw, sp=2)
    # a 32k shard's layer inputs on each rank; the saved fp32 logits of the 4k response tokens stay whole
    logits = 4096 * shape.vocab * 4 * 3
    assert two["activations"] - logits == pytest.approx((one["activations"] - logits) / 2)
    assert two["other"] == pytest.approx(one["other"] / 2)  # one checkpointed layer's recomputation
    assert two["logits_buffer"] == one["logits_buffer"]  # the 4k response tokens all sit in the last shard
    assert "sp_buffers" not in one and 0 < two["sp_buffers"] < two["activations"]
    short = pass_memory(shape, "bf16", 1, 65536, 65000, **kw, sp=4)
    assert short["logits_buffer"] == pytest.approx(one["logits_buffer"] * 16384 / 4096)  # at most a shard scored


def test_tiled_mlps_hold_one_tile_of_ffn_intermediates():
    from verl_ds.diagnostics.memory.estimate import pass_memory

    shape = M.load_shape(str(LLAMA_8B))
    kw = dict(head="lm", grad=True, grad_checkpointing=True)
    plain = pass_memory(shape, "bf16", 1, 32768, 512, **kw)
    tiled = pass_memory(shape, "bf16", 1, 32768, 512, **kw, tiled_mlp=True)
    ffn_saved = 32768 * 11 * shape.ffn * 2 // 2  # a layer's ffn-sized saved tensors, bf16, whole row
    tile = shape.hidden * 11 * shape.ffn * 2 // 2  # one tile of `hidden` tokens
    assert plain["other"] - tiled["other"] == pytest.approx(2 * (ffn_saved - tile))  # forward + backward
    assert tiled["activations"] == plain["activations"]  # checkpointed: layer inputs only either way
    assert pass_memory(shape, "bf16", 1, 512, 512, **kw, tiled_mlp=True) == pass_memory(
        shape, "bf16", 1, 512, 512, **kw
    )


def test_a_shared_prompt_counts_once_in_a_micro_batchs_pass():
    """With shared prefixes (`roles/prefix.py`), a micro-batch of 8 rows of 512 prompt + 512 response tokens
    (2 groups of 4) runs one sequence of 2 x 512 + 8 x 512 tokens, scoring all 8 x 512 responses, where the
    FLOP count says the shared pass runs (an 8B model's projections); the actor's update activations that
    grow with the tokens run fall with it (5,120 / 8,192), and `run_tokens` counts the shared tokens once."""
    from verl_ds.diagnostics.memory.estimate import roles_memory

    shape = M.load_shape(str(LLAMA_8B))
    base = ["data.max_prompt_length=512", "rollout.max_new_tokens=512", "rollout.max_model_len=1024"]
    base += ["rollout.n=4", "trainer.prompts_per_step=4", "roles.actor.micro_batch_size=8"]
    base += ["precision.enable_grad_checkpointing=true", "precision.actor_dtype=bf16"]
    shared, plain = (
        load_config("examples/grpo_cpu_tiny.yaml", [*base, f"model.share_prompt={s}"]) for s in ("true", "false")
    )
    w = M.workload(shared, 1)
    assert (w.shared_prefix, w.n) == (512, 4)
    assert w.micro_batch(8, shape.hidden) == (1, 2 * 512 + 8 * 512, 8 * 512)
    assert w.run_tokens(8, shape.hidden) == 2 * (2 * 512 + 8 * 512)  # 16 rows: two micro-batches
    assert M.workload(plain, 1).micro_batch(8, shape.hidden) == (8, 1024, 512)
    assert w.micro_batch(8, 64) == (8, 1024, 512)  # a tiny model: the pack's square attention costs more
    ds = render_ds_configs(shared, 1, run_precision(shared), {"actor": 3, "reference": 3})
    acts = [roles_memory(c, shape, ds, 1)["actor"]["update"]["activations"] for c in (shared, plain)]
    logits = 8 * 512 * shape.vocab * 4 * 3  # the responses' saved fp32 logits: every row's, either way
    assert acts[0] - logits == pytest.approx((acts[1] - logits) * 5120 / 8192)  # the checkpointed layer inputs


def test_a_trainer_rank_apart_holds_no_engine_and_shares_the_node_with_the_rollout_ranks(monkeypatch, capsys):
    """`trainer.rollout_ranks`: a trainer rank's estimate holds no rollout engine (on a GPU its device keeps only
    the sync's gathered module; on a CPU trainer rank 0 also keeps the weights it last sent, in the actor's
    dtype, and the sync's message); `debug memory` names a rollout rank's engine apart; a CPU rank's budget
    is the node's memory over every rank on it, the rollout ranks included."""
    from verl_ds.diagnostics.memory import budget

    monkeypatch.setenv("WORLD_SIZE", "2")  # as the launcher sets it for 1 trainer + 1 rollout rank
    monkeypatch.delenv("VERL_DS_LAUNCH_WORLD", raising=False)
    both = ["precision.actor_dtype=bf16", "precision.reference_dtype=bf16", "precision.rollout_dtype=bf16"]
    colocated = load_config("examples/grpo_cpu_tiny.yaml", both)
    apart = load_config("examples/grpo_cpu_tiny.yaml", [*both, "trainer.rollout_ranks=1", "algorithm.tis_cap=2.0"])
    shape = M.load_shape(str(LLAMA_8B))
    ds = render_ds_configs(apart, 1)
    gpu = {name: M.estimate_memory(c, shape, ds, 1, "bf16", 80) for name, c in (("co", colocated), ("apart", apart))}
    engine = {name: {s: est[s]["rollout"] for s in M.STAGES} for name, est in gpu.items()}
    assert "kv_cache" in engine["co"]["rollout"]  # vLLM's pool on the rank that also trains
    assert all(not part for s, part in engine["apart"].items() if s != "sync")
    assert set(engine["apart"]["sync"]) == {"other"} and engine["apart"]["sync"]["other"] < 2 * 2**30
    cpu = M.estimate_memory(apart, shape, ds, 1, "bf16")
    assert cpu["update"]["rollout"] == {"weights_sent": shape.params("lm") * 2}
    monkeypatch.setattr(budget, "_cgroup_limit", lambda: float(2**30))  # below any machine's RAM
    monkeypatch.setenv("LOCAL_SIZE", "1")
    assert budget.rank_budget(colocated, 1, False) == 2**30 and budget.rank_budget(apart, 1, False) == 2**29
    assert _debug_memory_8b(*both, "trainer.rollout_ranks=1", "algorithm.tis_cap=2.0") == 0
    out = capsys.readouterr().out
    assert "a rollout rank holds its vllm engine alone" in out and "kv_cache" in out
