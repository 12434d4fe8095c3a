"""In-process vLLM runs in its own pytest process: at shutdown it destroys the default process
group (PLATFORM.md), which would break every later DeepSpeed test sharing this interpreter."""
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_inprocess_cases_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                          str(HERE / "inprocess_cases.py")], env=env, cwd=HERE.parents[1],
                         capture_output=True, text=True, timeout=600)
    print(out.stdout[-2000:])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "2 passed" in out.stdout
