"""Sequence parallelism (DeepSpeed's Ulysses SP, `roles/sequence_parallel.py`) on 2 CPU ranks under the real
launcher: a frozen policy role's logprobs with each row split over the ranks equal its unsplit pass's
(rows of unequal length, lengths SP does not divide, shard boundaries inside responses), at ZeRO 0 and 3."""

import subprocess
from pathlib import Path

import pytest

from tests.roles.test_two_ranks import _port
from tests.subprocess_env import child_env

ROOT = Path(__file__).resolve().parents[2]


def _run(model_dir: str, plant: str = ""):
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), SP_PLANT=plant)
    script = str(ROOT / "tests" / "roles" / "sp_script.py")
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(_port()), script, model_dir]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.numerics
@pytest.mark.e2e
def test_sequence_parallel_equals_the_unsplit_pass_on_two_ranks(tiny_model_dir):
    out = _run(tiny_model_dir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SP_OK" in out.stdout


@pytest.mark.e2e
@pytest.mark.parametrize(
    "plant, caught",
    [
        ("divisor", "ZeRO-1 actor gradients"),  # the loss scaled by the world: SP times too large at ZeRO-1/2
        ("boundary", "SP 2 logprobs differ"),  # each shard's last label dropped
    ],
)
def test_sequence_parallel_checks_catch_planted_bugs(tiny_model_dir, plant, caught):
    out = _run(tiny_model_dir, plant)
    assert out.returncode != 0 and caught in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
