"""2 ranks under the real deepspeed launcher: ZeRO-3 reference -> sync_distributed -> rank-0 vLLM
(multiprocess) -> generate_distributed, checked against HF on both ranks."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rollout.helpers import free_port

pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_zero3_sync_into_rank0_vllm_under_deepspeed(model_pair):
    start, trained = model_pair
    launcher = Path(sys.executable).parent / "deepspeed"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    port = free_port()
    cmd = [str(launcher), "--num_gpus", "2", "--master_port", str(port),
           str(ROOT / "tests/rollout/e2e_sync_script.py"), trained, start]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    finally:   # DeepSpeed's CPU shm all-reduce leaves ~67 MB per rank in /dev/shm, named by port
        for f in Path("/dev/shm").glob(f"deepspeed_*_{port}_*"):
            f.unlink(missing_ok=True)
    out = proc.stdout + proc.stderr
    print("\n".join(line for line in out.splitlines() if "dlogprob" in line or "sync metrics" in line))
    assert proc.returncode == 0, out[-6000:]
    assert "ROLLOUT_E2E_OK" in out, out[-6000:]
