"""vLLM rollout tests that need a process of their own (see vllm_cases.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocess_env import child_env

HERE = Path(__file__).resolve().parent
pytest.importorskip("vllm")


@pytest.mark.numerics
def test_vllm_cases_in_a_fresh_process():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(HERE / "vllm_cases.py")],
        env=child_env(),
        cwd=HERE.parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    print("\n".join(line for line in out.stdout.splitlines() if "vLLM" in line or "passed" in line))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "12 passed" in out.stdout
