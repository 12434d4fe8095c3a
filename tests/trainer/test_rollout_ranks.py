"""Rollout ranks apart from trainer ranks (`trainer.rollout_ranks`): real ranks under the launcher, a
real DeepSpeed engine on the trainer rank, a real rollout engine on the rollout rank, rows and weights
over the launch's bridge (`dist.Bridge`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.subprocess_env import child_env
from verl_ds.config import load_config
from verl_ds.dist import _free_port
from verl_ds.errors import ConfigError, ConfigErrors
from verl_ds.rollout.engines.remote import apply_changes, changed_elements, part_bytes
from verl_ds.trainer.checkpoint import check_placement, list_checkpoints

ROOT = Path(__file__).resolve().parents[2]


def _launch(run_dir: Path, mode: str, *overrides: str) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, "-m", "verl_ds.launcher", "--num_ranks", "2", "--master_port", str(_free_port()), "--"]
    cmd += ["--module", "tests.trainer.split_script", str(run_dir), mode, *overrides]
    out = subprocess.run(cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out.stdout[-3000:] + out.stderr[-3000:]
    return out, json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("split") / "run"
    out, res = _launch(run_dir, "run")
    return out, res, run_dir


def test_rollout_ranks_stream_one_step_ahead_and_every_sync_is_probed(whole_run):
    """1 trainer + 1 rollout rank, 4 steps (fp32): step 0's rows are, bit for bit, what a colocated engine
    samples for the same prompts and seeds on the same weights; every later step trains rows the weights of
    the step before sampled (policy lag 1), and the weights each step sent, landed in the rollout rank's
    engine, are checked by the probe on them (gap within fp32's rounding); bytes sent never exceed the
    tensors'."""
    out, res, _ = whole_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert res["line"] is None and res["rows_equal"]
    steps = res["steps"]
    assert [m["rollout/policy_lag"] for m in steps] == [0.0, 1.0, 1.0, 1.0]
    assert all(m["rollout/sync_probe_gap"] <= 1e-5 for m in steps[1:])
    assert all(0 < m["sync/bytes_sent"] <= m["sync/bytes_full"] for m in steps)


def test_a_weight_that_did_not_reach_the_rollout_rank_stops_the_run_before_it_trains(tmp_path):
    """A vLLM engine on the rollout rank; the syncs after step 0 hold q_proj back at its initial value: the
    probe the rollout rank samples on what landed differs from the trainer's scoring of it, and the next
    step stops in one line before its optimizer step."""
    _, res = _launch(tmp_path / "run", "stale", "rollout.engine=vllm", "rollout.block_size=32")
    assert res["line"] is not None and "sync" in res["line"]
    assert res["optimizer_stepped"] is False


def test_a_run_resumed_apart_trains_what_the_uninterrupted_run_trains(whole_run, tmp_path):
    """4 steps in one run against 2 steps, then the same run resumed to 4 from its final checkpoint: the
    checkpoint holds step 2's rows (sampled on step 1's weights), the rollout rank starts at step 3 on the
    weights the resume sends, and steps 3-4 and the exported model are bitwise the uninterrupted run's.
    A checkpoint written apart is refused colocated, in one line."""
    whole, cut = whole_run[2], tmp_path / "cut"
    for run_dir, steps, resume in ((cut, 2, "none"), (cut, 4, "auto")):
        out, _ = _launch(run_dir, "fit", f"trainer.steps={steps}", f"trainer.resume={resume}")
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (whole, cut)]
    assert [m["step"] for m in rows[1]] == [1, 2, 3, 4]
    for a, b in zip(rows[0], rows[1]):
        seconds = ("timing_s/", "rollout_rank/update_weights", "rollout_rank/sync_check", "perf/", "memory/")
        same = [k for k in a if not k.startswith(seconds)]
        assert {k: a[k] for k in same} == {k: b.get(k) for k in same}, a["step"]
    assert rows[1][2]["rollout/policy_lag"] == 1.0  # step 3: the checkpoint's rows, sampled a step behind
    model = [(d / "final_model" / "model.safetensors").read_bytes() for d in (whole, cut)]
    assert model[0] == model[1]
    with pytest.raises(ConfigError, match="rollout_ranks 1 and this run has 0"):
        check_placement(list_checkpoints(cut / "checkpoints")[-1], 1, 1, 0)


@pytest.mark.parametrize("changed", [0, 3, 40])
def test_changed_elements_rebuild_the_tensor_in_fewer_bytes_where_few_changed(changed):
    g = torch.Generator().manual_seed(0)
    before = torch.randn(64, generator=g).to(torch.bfloat16)
    now = before.clone()
    now[torch.randperm(64, generator=g)[:changed]] += 1.0
    part = changed_elements(now, before)
    assert torch.equal(apply_changes(before, part), now)
    sparse = changed * (4 + 2) < 64 * 2  # an int32 index and a bf16 value each
    assert isinstance(part, dict) == sparse and part_bytes(part) == (changed * 6 if sparse else 128)
    assert changed_elements(now, None) is now  # nothing held yet: the whole tensor


def test_what_rollout_ranks_do_not_run_yet_is_refused_in_one_pass(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigErrors) as e:
        load_config(
            None,
            ["trainer.rollout_ranks=1", "rollout.partial.enabled=true", "trainer.val_every=5", "rollout.n=2"],
        )
    keys = {err.where for err in e.value.errors}
    assert {"algorithm.tis_cap", "rollout.partial.enabled", "trainer.val_every"} <= keys
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.rollout_ranks=1", "algorithm.tis_cap=2.0"])
    assert "leaves none to train" in str(e.value)
