"""`verl-ds bench precision`: 2 steps per dtype on a tiny model, HF rollout; table, JSON and PNG."""

import json

import pytest

from tests.diagnostics.helpers import parse_md_tables, tiny_overrides
from verl_ds import cli
from verl_ds.programs.bench_precision import parse_cells


def test_bench_precision_two_steps_per_dtype(tmp_path, capsys):
    out = tmp_path / "bench"
    args = (
        [
            "bench",
            "precision",
            "--config",
            "examples/grpo_cpu_tiny.yaml",
            "--dtypes",
            "fp32,bf16,fp16",
            "--steps",
            "2",
            "--out",
            str(out),
        ]
        + tiny_overrides(tmp_path / "run")
        + ["trainer.prompts_per_step=2"]
    )
    assert cli.main(args) == 0
    (table,) = parse_md_tables(capsys.readouterr().out)
    assert [r[0] for r in table[1:]] == ["fp32", "bf16", "fp16"]
    res = {r["dtype"]: r for r in json.loads((out / "bench_precision.json").read_text())["results"]}
    assert res["fp16"]["loss_scale"][0] > 1 and res["fp32"]["loss_scale"] == [1.0, 1.0]
    # 16-bit weights halve the actor's parameter memory (ZeRO-3 keeps fp32 masters either way)
    for dtype in res:
        assert res[dtype]["steps"] == 2 and res[dtype]["peak_memory_mib"]["actor"] > 0
    assert res["fp16"]["peak_memory_mib"]["reference"] < 0.6 * res["fp32"]["peak_memory_mib"]["reference"]
    assert (out / "bench_precision.png").stat().st_size > 0 and (out / "bench_precision.md").exists()


def test_bench_precision_rejects_unknown_dtype(capsys):
    assert cli.main(["bench", "precision", "--config", "examples/grpo_cpu_tiny.yaml", "--dtypes", "fp8"]) == 2
    assert "error: --dtypes" in capsys.readouterr().err


@pytest.mark.numerics
def test_bench_precision_matrix_crosses_trainer_and_rollout_dtypes(tmp_path, capsys):
    """--matrix: every (trainer, rollout) pair; matched cells keep the trainer and the rollout on the
    same numbers (a tiny mismatch), a bf16 rollout under an fp32 trainer shows the rounding gap."""
    out = tmp_path / "bench"
    args = (
        ["bench", "precision", "--config", "examples/grpo_cpu_tiny.yaml", "--dtypes", "fp32,bf16", "--matrix"]
        + ["--steps", "1", "--out", str(out)]
        + tiny_overrides(tmp_path / "run")
        + ["trainer.prompts_per_step=2"]
    )
    assert cli.main(args) == 0
    (table,) = parse_md_tables(capsys.readouterr().out)
    assert [r[0] for r in table[1:]] == ["fp32", "fp32/bf16", "bf16/fp32", "bf16"]
    assert table[0][:9] == [
        "dtype (trainer/rollout)",
        "mean abs Δlogprob step 1",
        "over the run",
        "max abs Δlogprob step 1",
        "k3 step 1",
        "phantom clip step 1",
        "abs Δlogprob p99 step 1",
        "seq phantom clip step 1",
        "trainer vs itself, max step 1",
    ]
    res = {r["dtype"]: r for r in json.loads((out / "bench_precision.json").read_text())["results"]}
    assert (res["fp32/bf16"]["trainer_dtype"], res["fp32/bf16"]["rollout_dtype"]) == ("fp32", "bf16")
    assert res["fp32"]["mismatch_step1"] < 1e-4  # same weights, same dtype: kernels' rounding only
    # a bf16 rollout rounds what the fp32 trainer does not: a fraction of bf16's unit roundoff 2^-8
    # (under native kernels or fp32 products alike), far above fp32's own rounding
    assert 2.0**-16 < res["fp32/bf16"]["mismatch_step1"] < 2.0**-8, res["fp32/bf16"]
    for r in res.values():
        assert 0.0 <= r["phantom_clip_step1"] <= 1.0 and 0.0 <= r["seq_phantom_clip_step1"] <= 1.0
        assert r["p99_step1"] <= r["mismatch_max_step1"] and r["self_max_step1"] is not None
    assert res["fp32"]["self_max_step1"] < 1e-5  # the fp32 trainer against itself: rounding


def test_bench_precision_cells_name_a_subset():
    """--cells: trainer/rollout pairs in the order given; one dtype means both sides."""
    assert parse_cells("fp32, bf16,fp16/fp16,fp32/bf16") == [
        ("fp32", "fp32"),
        ("bf16", "bf16"),
        ("fp16", "fp16"),
        ("fp32", "bf16"),
    ]


def test_bench_precision_rejects_a_bad_cell(capsys):
    args = ["bench", "precision", "--config", "examples/grpo_cpu_tiny.yaml", "--cells", "fp32,bf16/fp8"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "error: --cells" in err and "'bf16/fp8'" in err


@pytest.mark.numerics
def test_bench_precision_cells_run_one_after_another_on_vllm(tmp_path, capsys):
    """The cells run in one process, each with its own vLLM engine: vLLM's teardown destroys the world
    group under DeepSpeed, and the next cell's engines must not keep the dead one (the second cell
    used to fail in DeepSpeed's broadcast: "Group ... is not registered")."""
    out = tmp_path / "bench"
    args = (
        ["bench", "precision", "--config", "examples/grpo_cpu_tiny.yaml", "--cells", "fp32,fp32/fp16"]
        + ["--steps", "1", "--out", str(out)]
        + [o for o in tiny_overrides(tmp_path / "run") if not o.startswith("model.tiny.")]  # vLLM: head_dim >= 16
        + ["rollout.engine=vllm", "rollout.kv_cache_gb=0.05", "trainer.prompts_per_step=2"]
    )
    assert cli.main(args) == 0
    res = json.loads((out / "bench_precision.json").read_text())["results"]
    assert [r["dtype"] for r in res] == ["fp32", "fp32/fp16"]
    assert (res[1]["trainer_dtype"], res[1]["rollout_dtype"]) == ("fp32", "fp16")
    # the fp16 vLLM engine really served cell 2: its rounding shows, within fp16's unit roundoff 2^-11
    assert res[0]["mismatch_step1"] < 1e-4 and 2.0**-16 < res[1]["mismatch_step1"] < 2.0**-11, res
