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
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from verl_ds.diagnostics import progress


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
    # each rank keeps where it is in this folder (`diagnostics.progress`): a rank that a signal ends
    # (the OOM killer's SIGKILL) is named in one line with its step, phase and last checkpoint
    status_dir = os.environ[progress.ENV] = tempfile.mkdtemp(prefix="verl-ds-status-")
    watch = _Watch(n)
    threading.Thread(target=watch.run, daemon=True).start()
    try:
        launch.main()
        rc = 0
    except SystemExit as e:  # a rank failed or a signal arrived: the launcher has already cleaned up
        rc = e.code if isinstance(e.code, int) else int(e.code is not None)
    death = watch.first_death
    if death is None and isinstance(rc, int) and rc < 0:  # the launcher reaped it before the watch looked
        only = list(watch.ranks.items()) if len(watch.ranks) == 1 else [(0, -1)]
        death = (*only[0], rc)
    if rc and death is not None:
        pid, rank, code = death
        status = progress.read(status_dir, max(rank, 0))  # an unknown rank: rank 0's step and phase
        print(f"[verl-ds] error: {progress.death_line(rank, pid, -code, oom_record(pid, watch.oom_kills), status)}",
              file=sys.stderr)  # fmt: skip
    shutil.rmtree(status_dir, ignore_errors=True)
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


class _Watch:
    """Watches the ranks every 50 ms without reaping them (`launch.main` keeps handling failures and
    signals): ends the process as soon as all `n` ranks have exited 0 (DeepSpeed's launcher checks once
    a second and sleeps a second more after the last one ends, ~1.5 s a run), and notes the first rank a
    signal ended (pid, local rank, its negative code) before the launcher kills the others."""

    def __init__(self, n: int):
        self.n = n
        self.first_death: tuple[int, int, int] | None = None
        self.ranks: dict[int, int] = {}  # pid -> local rank
        self.oom_kills = cgroup_oom_kills()

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        while True:
            time.sleep(0.05)
            children = me.children()
            for c in children:
                if c.pid not in self.ranks:
                    self.ranks[c.pid] = _local_rank(c)
            codes = {c.pid: _exit_code(c.pid) for c in children}
            if self.first_death is None:
                dead = [(pid, code) for pid, code in codes.items() if code is not None and code < 0]
                if dead:
                    pid, code = dead[0]
                    self.first_death = (pid, self.ranks.get(pid, -1), code)
            if len(codes) == self.n and all(code == 0 for code in codes.values()):
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)


def _local_rank(proc) -> int:
    """A rank's LOCAL_RANK, from the `--local_rank=N` DeepSpeed's launcher puts on its command line."""
    try:
        for arg in proc.cmdline():
            if arg.startswith("--local_rank="):
                return int(arg.split("=", 1)[1])
    except Exception:  # it ended before we looked
        pass
    return -1


def cgroup_oom_kills() -> int | None:
    """The OOM kills this process's memory cgroup has counted (v2 `memory.events`, v1 `oom_control`)."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            for line in open(path):
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            continue
    return None


def oom_record(pid: int, kills_before: int | None) -> str | None:
    """What the system says of an OOM kill of `pid`: the kernel log's line, or the cgroup's count
    going up; None when it says nothing (no access, or another cause)."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        log = ""
    for line in reversed(log.splitlines()):
        if f"Killed process {pid} " in line or f"pid={pid}," in line and "oom" in line.lower():
            return "the kernel log: " + line.split("] ", 1)[-1].strip()
    after = cgroup_oom_kills()
    if kills_before is not None and after is not None and after > kills_before:
        return f"the memory cgroup counted {after - kills_before} OOM kill(s) during the run"
    return None


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
