"""`verl_ds.launcher --gpus` (launch/train.sh and launch/gpu_check.sh on a GPU node): one rank per GPU
the node may use, a scheduler's CUDA_VISIBLE_DEVICES entries (indices or GPU-/MIG- UUIDs) passed to
the ranks as given, through DeepSpeed's real per-node launcher (its ranks here only print)."""

import re
import subprocess
import sys

from tests.rollout.helpers import free_port
from tests.subprocess_env import child_env

# what nvidia-smi prints on a node with 2 GPUs, the first split into 2 MIG instances
FAKE_SMI = """#!/bin/sh
case "$*" in
  *--query-gpu=index*) printf '0\\n1\\n' ;;
  *-L*) printf 'GPU 0: H100 (UUID: GPU-a)\\n  MIG 3g.40gb Device 0: (UUID: MIG-b)\\n'
        printf '  MIG 3g.40gb Device 1: (UUID: MIG-c)\\nGPU 1: H100 (UUID: GPU-d)\\n' ;;
esac
"""
RANK = "import os; print(f\"<rank {os.environ['LOCAL_RANK']} {os.environ['CUDA_VISIBLE_DEVICES']}>\", flush=True)"


def launch(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir(exist_ok=True)
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    path = f"{smi.parent}:{child_env()['PATH']}"
    cmd = [
        sys.executable,
        "-m",
        "verl_ds.launcher",
        "--gpus",
        *args,
        "--master_port",
        str(free_port()),
        "--",
        str(script),
    ]
    return subprocess.run(cmd, env=child_env(PATH=path, **env), capture_output=True, text=True, timeout=120)


def ranks(out: subprocess.CompletedProcess) -> list[str]:
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # the ranks' lines may land inside the launcher's own log lines (one pipe)
    return sorted(re.findall(r"<(rank \d [^>]*)>", out.stdout))


def test_the_ranks_get_the_schedulers_devices_as_given_and_count_gpus_not_mig_lines(tmp_path):
    # UUIDs pass through as CUDA_VISIBLE_DEVICES; each rank picks its own by LOCAL_RANK
    got = ranks(launch(tmp_path, CUDA_VISIBLE_DEVICES="GPU-d,MIG-b"))
    assert got == ["rank 0 GPU-d,MIG-b", "rank 1 GPU-d,MIG-b"]
    # --num_ranks takes the first entries (indices stay the scheduler's, in its order)
    assert ranks(launch(tmp_path, "--num_ranks", "1", CUDA_VISIBLE_DEVICES="3,1")) == ["rank 0 3"]
    # nothing visible set: every GPU by index (nvidia-smi -L would count 4 lines here)
    assert ranks(launch(tmp_path, CUDA_VISIBLE_DEVICES="")) == ["rank 0 0,1", "rank 1 0,1"]
    too_many = launch(tmp_path, "--num_ranks", "3", CUDA_VISIBLE_DEVICES="")
    assert too_many.returncode != 0 and "--num_ranks must be 1..2" in too_many.stderr
