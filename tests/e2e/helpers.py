"""Run `verl-ds train` through the real deepspeed launcher (2 CPU ranks, gloo, vLLM) and read results."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.subprocess_env import child_env

ROOT = Path(__file__).resolve().parents[2]


def train_cmd(config: str, run_dir, *overrides, ranks: int = 2, **env: str):
    # the launcher picks a free port; don't inherit this test process's own process-group env.
    # `env`: launch/train.sh's variables (HOSTFILE, MASTER_ADDR, MASTER_PORT)
    return [
        "bash",
        str(ROOT / "launch" / "train.sh"),
        str(ROOT / "examples" / config),
        f"trainer.run_dir={run_dir}",
        *overrides,
    ], child_env(NUM_RANKS=str(ranks), **env)


def run_train(config: str, run_dir, *overrides, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    cmd, env = train_cmd(config, run_dir, *overrides, **env)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def wait_for_step(proc: subprocess.Popen, run_dir, step: int, timeout: float) -> None:
    """Return once `step` is logged in run_dir's metrics.jsonl (or `proc` ended, or the timeout)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        path = Path(run_dir) / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        if any(line.endswith("}") and json.loads(line)["step"] >= step for line in lines[-2:]):
            return
        time.sleep(0.1)


def run_until_step(config: str, run_dir, step: int, *overrides, timeout: int = 600, **env: str):
    """Start training and kill the whole launcher process group once `step` is logged."""
    cmd, env = train_cmd(config, run_dir, *overrides, **env)
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, start_new_session=True
    )
    try:
        wait_for_step(proc, run_dir, step, timeout)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


# per-step numbers that are not the algorithm's: wall times and process memory
UNCOMPARED = ("timing_s/", "perf/", "memory/")


def assert_same_metrics(want: list[dict], got: list[dict], what: str) -> int:
    """Every compared key of every step bitwise equal; returns how many values were compared."""
    assert [r["step"] for r in got] == [r["step"] for r in want], (what, [r["step"] for r in got])
    n = 0
    for w, g in zip(want, got):
        keys = sorted(k for k in w if not k.startswith(UNCOMPARED))
        assert keys == sorted(k for k in g if not k.startswith(UNCOMPARED)), (what, w["step"])
        diff = {k: (w[k], g[k]) for k in keys if w[k] != g[k]}
        assert not diff, f"{what}: step {w['step']} differs: {diff}"
        n += len(keys)
    return n


def wandb_history(run_dir) -> list[dict]:
    runs = sorted((Path(run_dir) / "wandb").glob("offline-run-*"))
    assert runs, "no W&B offline run written"
    out = subprocess.run(
        ["wandb", "leet", "inspect", "--json", str(runs[-1])], capture_output=True, text=True, timeout=120
    )
    recs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return [r["history"] for r in recs if r.get("type") == "history"]


def length_reward(response: str, answer: str) -> float:
    """A dense test reward (by dotted path): varied scores give non-zero advantages from step 1,
    unlike the sparse exact-match reward of an untrained model."""
    return float(len(response))
