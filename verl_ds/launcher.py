"""`python -m verl_ds.launcher [--gpus] [--num_ranks N] --master_port P -- SCRIPT_ARGS...`: one node, no hostfile.

Runs DeepSpeed's per-node launcher (`deepspeed.launcher.launch`: the process that spawns the ranks,
sets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR, forwards SIGINT/SIGTERM and kills the ranks when one
fails) in this process, with the world the `deepspeed` runner would hand it for `--num_gpus N` on
localhost. On one node the runner only builds that world and starts the launcher, so skipping it
saves its own import of deepspeed and torch and two interpreter teardowns (~3-4 s a run on 2 CPU
cores); ending as soon as the ranks have succeeded saves the launcher's final poll and sleep (~1.5 s).
Multi-node runs (a hostfile) go through the `deepspeed` runner.

`--gpus`: one rank per GPU this node may use (`visible_gpus`), the first N with `--num_ranks`. The
launcher sets every rank's CUDA_VISIBLE_DEVICES to the world's entries and each rank takes the one at
its LOCAL_RANK, so a scheduler's entries pass through as given; the runner's `--include` (or
`--num_gpus`) would take integer indices only, of all the node's GPUs, and drops CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m verl_ds.launcher")
    p.add_argument("--num_ranks", type=int, default=0, help="ranks; with --gpus, 0: one per GPU")
    p.add_argument("--gpus", action="store_true", help="one rank per GPU this node may use (`visible_gpus`)")
    p.add_argument("--master_port", type=int, required=True)
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- then what follows `deepspeed [opts]`")
    args = p.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    devices = visible_gpus() if args.gpus else list(range(args.num_ranks))
    n = args.num_ranks or len(devices)
    if n < 1 or n > len(devices) or not script:
        p.error(f"--num_ranks must be 1..{len(devices)} ({devices}) and a script (or --module M) must follow --")

    from deepspeed.launcher import launch
    from deepspeed.launcher.runner import encode_world_info

    world = encode_world_info({"localhost": devices[:n]})
    sys.argv = [
        "deepspeed.launcher.launch",
        f"--world_info={world}",
        "--master_addr=127.0.0.1",
        f"--master_port={args.master_port}",
        # its INFO lines (the world dict, "Setting CUDA_VISIBLE_DEVICES=0,1" even on a CPU, each rank's
        # command line) are its bookkeeping, not the run's; its warnings and errors still show
        "--log_level=warning",
        *script,
    ]
    threading.Thread(target=_end_when_ranks_succeed, args=(n,), daemon=True).start()
    try:
        launch.main()
        rc = 0
    except SystemExit as e:  # a rank failed or a signal arrived: the launcher has already cleaned up
        rc = e.code if isinstance(e.code, int) else int(e.code is not None)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # the ranks are gone; skip the teardown of an interpreter holding torch


def visible_gpus() -> list:
    """The GPUs this node's ranks may use, in order: CUDA_VISIBLE_DEVICES's entries as given (indices,
    or GPU-/MIG- UUIDs: a scheduler's choice), else every GPU by index (`nvidia-smi -L` would count
    each MIG instance as a line too)."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not given:
        given = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, check=True
        ).stdout.replace("\n", ",")
    return [d.strip() for d in given.split(",") if d.strip()]


def _end_when_ranks_succeed(n: int) -> None:
    """DeepSpeed's launcher checks its ranks once a second and sleeps a second more after the last
    one ends (~1.5 s a run). This thread looks every 50 ms, without reaping them (`launch.main` keeps
    handling failures and signals), and ends the process as soon as all `n` ranks have exited 0."""
    import psutil

    me = psutil.Process()
    while True:
        time.sleep(0.05)
        pids = [c.pid for c in me.children()]
        if len(pids) == n and all(_exit_code(pid) == 0 for pid in pids):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def _exit_code(pid: int) -> int | None:
    """The exit code of a child that has ended (left for its parent to reap), else None."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # already reaped by the launcher: it has the code
        return None
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


if __name__ == "__main__":
    main()
