"""2 ranks under the real deepspeed launcher: identical ZeRO-3 gathers, a step keeps ranks in sync, and
at ZeRO-0 our gradient all-reduce equals DeepSpeed's bitwise."""

import socket
import subprocess
from pathlib import Path

import pytest

from tests.subprocess_env import child_env

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.numerics
@pytest.mark.e2e
@pytest.mark.parametrize("stage", [0, 3])
def test_zero3_gather_identical_and_step_in_sync_on_two_ranks(tiny_model_dir, stage):
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        "deepspeed",
        "--num_gpus",
        "2",
        "--master_port",
        str(_port()),
        str(ROOT / "tests" / "roles" / "two_rank_script.py"),
        tiny_model_dir,
        str(stage),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"TWO_RANK_OK stage={stage}" in out.stdout
