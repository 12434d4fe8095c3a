"""Long rows on one rank, through the real launcher: memory comes back between steps (glibc and
tcmalloc), and a rank the kernel kills is named in one line."""

import os
import signal
import subprocess
import time

import psutil
import pytest

from tests.e2e.helpers import ROOT, read_metrics, run_train, train_cmd, wait_for_step
from tests.e2e.long_rows import long_row_overrides, write_long_prompts

MIB = 2**20


@pytest.mark.parametrize("malloc", ["tcmalloc", "glibc"])
def test_the_floor_after_each_step_holds_over_three_long_row_steps(tmp_path, malloc):
    """Each step's transient memory (12k tokens of activations, generation buffers) goes back to the
    kernel at the step's end: the floor it leaves stays where step 1 left it (within 32 MiB), well
    under the update's peak. Without the release, a caching allocator keeps its high-water mark."""
    data = write_long_prompts(tmp_path / "long.jsonl")
    env = {"VERL_DS_NO_TCMALLOC": "1"} if malloc == "glibc" else {}
    out = run_train("grpo_cpu_tiny.yaml", tmp_path / "run", *long_row_overrides(data, 3), ranks=1, **env)
    assert f"memory allocator: {malloc}" in out.stdout + out.stderr
    rows = read_metrics(tmp_path / "run")
    floors = [r["memory/floor/process/rss_mib"] for r in rows]
    peaks = [r["memory/update/process/rss_peak_mib"] for r in rows]
    assert len(floors) == 3
    assert max(floors) - floors[0] <= 32, floors  # no step leaves more behind than the first
    assert all(p - f >= 100 for p, f in zip(peaks, floors)), (peaks, floors)  # the transient was there


def test_a_rank_killed_mid_step_is_named_with_its_step_phase_and_last_checkpoint(tmp_path):
    """SIGKILL, as the OOM killer sends it: the launcher's last line names the rank, the likely cause,
    the step and phase the rank was in, and the checkpoint to resume from."""
    data = write_long_prompts(tmp_path / "long.jsonl")
    run_dir = tmp_path / "run"
    cmd, env = train_cmd("grpo_cpu_tiny.yaml", run_dir, *long_row_overrides(data, 6), "checkpoint.every=1", ranks=1)
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
    )
    try:
        wait_for_step(proc, run_dir, 1, timeout=240)
        time.sleep(1.0)  # into step 2
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "--local_rank=0" in p.cmdline()]
        assert ranks, "no rank process found"
        rank = ranks[0]
        rank.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    line = next(x for x in err.splitlines() if "was killed by" in x)
    assert f"rank 0 (pid {rank.pid}) was killed by SIGKILL" in line
    assert "OOM killer" in line and "it was in step 2, phase " in line
    assert f"last good checkpoint: {run_dir / 'checkpoints' / 'step_1'}" in line
