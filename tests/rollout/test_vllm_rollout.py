"""vLLM rollout tests that need a process of their own (see vllm_cases.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
pytest.importorskip("vllm")


def test_vllm_cases_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                          str(HERE / "vllm_cases.py")], env=env, cwd=HERE.parents[1],
                         capture_output=True, text=True, timeout=600)
    print("\n".join(line for line in out.stdout.splitlines() if "vLLM" in line or "passed" in line))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "5 passed" in out.stdout
