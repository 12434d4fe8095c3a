"""Sequence parallelism (DeepSpeed's Ulysses SP, `roles/sequence_parallel.py`) on 2 CPU ranks under the real
launcher (`sp_script.py`): every role's passes with each row split over the ranks equal the unsplit ones
(rows of unequal length, lengths SP does not divide, shard boundaries inside responses), and the planted bugs
fail those checks."""

import subprocess
from pathlib import Path

import pytest

from tests.roles.test_two_ranks import _port
from tests.subprocess_env import child_env

ROOT = Path(__file__).resolve().parents[2]


def _run(model_dir: str, plants: bool = False):
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), SP_PLANTS="1" if plants else "")
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
def test_sequence_parallel_checks_catch_planted_bugs(tiny_model_dir):
    out = _run(tiny_model_dir, plants=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # on both ranks: the loss scaled by the world (SP times too large at ZeRO-1/2); each shard's last label dropped
    assert out.stdout.count("CAUGHT divisor: ZeRO-1 actor gradients") == 2, out.stdout[-3000:]
    assert out.stdout.count("CAUGHT boundary: SP 2 logprobs differ") == 2, out.stdout[-3000:]
    # a shared-prefix pack whose rows attend causally over the whole pack (its rule dropped)
    assert out.stdout.count("CAUGHT pack mask: SP 2 shared logprobs differ") == 2, out.stdout[-3000:]
    # the rule cleared after the forward: the checkpointed recompute in the backward attends over the pack
    # (torch's checkpoint sees the recompute save other tensors; a recompute that saved as many would fail
    # the gradients' check)
    assert out.stdout.count("CAUGHT pack reset: ") == 2, out.stdout[-3000:]
