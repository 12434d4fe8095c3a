"""Sequence parallelism (DeepSpeed's Ulysses SP, `roles/sequence_parallel.py`) on 2 CPU ranks under the real
launcher: a frozen policy role's logprobs with each row split over the ranks equal its unsplit pass's
(rows of unequal length, lengths SP does not divide, shard boundaries inside responses), at ZeRO 0 and 3."""

import subprocess
from pathlib import Path

import pytest

from tests.roles.test_two_ranks import _port
from tests.subprocess_env import child_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.numerics
@pytest.mark.e2e
@pytest.mark.parametrize("stage", [0, 3])
def test_sequence_parallel_logprobs_equal_the_unsplit_pass_on_two_ranks(tiny_model_dir, stage):
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    script = str(ROOT / "tests" / "roles" / "sp_script.py")
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(_port()), script, tiny_model_dir, str(stage)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"SP_OK stage={stage}" in out.stdout
