"""The multi-node check's runs: `bash launch/multinode_check.sh` runs `python -m tests.e2e.multinode`
with HOSTFILE (two loopback "nodes" behind a real sshd) and MASTER_ADDR set.

1. the tiny GRPO example as 1 node x 2 ranks (the one-node launcher);
2. the same as 2 nodes x 1 rank (the `deepspeed` runner, pdsh, ssh), rank 1 (node 127.0.0.2) killed
   with SIGKILL after step 3: the whole job exits non-zero within `DEAD_NODE_BOUND_S`, one line names
   rank 1, no rank process is left;
3. `resume: auto` of that run across the two nodes from its step-2 checkpoint: the killed run's steps
   1-2 and the resumed run's 3-4, every logged metric but timings and memory, bitwise equal the 1-node
   run's (`trainer.steps` only bounds the loop, so the killed run's longer one trains the same steps).
Prints one line per result with its time; any failure raises (exit 1).
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from tests.e2e.helpers import ROOT, assert_same_metrics, read_metrics, run_train, train_cmd, wait_for_step

CONFIG = "grpo_cpu_tiny.yaml"
STEPS = 4
OVERRIDES = [
    f"trainer.steps={STEPS}",
    "trainer.val_every=0",
    "trainer.val_before_train=false",
    "checkpoint.every=2",
    "trainer.collective_timeout_s=30",  # a bound for what no closed connection reports (README)
    # pinned: bitwise equality is about the two paths' logic, not the CPU kind `auto` follows
    *[f"precision.{k}_dtype=fp32" for k in ("actor", "reference", "rollout", "buffer")],
]
DEAD_NODE_BOUND_S = 60


def say(msg: str) -> None:
    print(f"[multinode] {msg}", flush=True)


def rank_pid(run_dir: Path, rank: int) -> int:
    """The pid of the training process of `rank` in the run writing to `run_dir` (on any node)."""
    for p in psutil.process_iter():
        try:
            cmd = p.cmdline()
            if f"trainer.run_dir={run_dir}" in cmd and "verl_ds.cli" in cmd and p.environ().get("RANK") == str(rank):
                return p.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} process of {run_dir}")


def rank_processes(run_dir: Path) -> list[int]:
    out = []
    for p in psutil.process_iter():
        try:
            if f"trainer.run_dir={run_dir}" in p.cmdline():
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def main() -> None:
    hostfile = os.environ["HOSTFILE"]
    nodes = {"HOSTFILE": hostfile, "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1")}
    base = Path(tempfile.mkdtemp(prefix="verl-ds-multinode-runs."))
    try:
        t = time.time()
        one = base / "one_node"
        run_train(CONFIG, one, *OVERRIDES, HOSTFILE="")
        say(f"1 node x 2 ranks: {STEPS} steps in {time.time() - t:.0f} s")

        killed = base / "killed"
        cmd, env = train_cmd(CONFIG, killed, *OVERRIDES, "trainer.steps=300", **nodes)
        with open(base / "killed.log", "w") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
            wait_for_step(proc, killed, 3, timeout=300)
            assert proc.poll() is None, "the run ended before step 3"
            victim = rank_pid(killed, 1)
            t = time.time()
            os.kill(victim, signal.SIGKILL)
            try:
                rc = proc.wait(timeout=DEAD_NODE_BOUND_S)
            except subprocess.TimeoutExpired as hung:
                os.killpg(proc.pid, signal.SIGKILL)
                for pid in rank_processes(killed):  # the other node's ranks are sshd's children
                    os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"the job still ran {DEAD_NODE_BOUND_S} s after rank 1 was killed") from hung
        took = time.time() - t
        log = (base / "killed.log").read_text()
        for node_rank in (0, 1):  # really the runner's path: one launcher per host, by pdsh
            assert f"nnodes=2, num_local_procs=1, node_rank={node_rank}" in log, log[-3000:]
        lines = [line for line in log.splitlines() if re.search(r"error: rank 1 is gone", line)]
        assert rc != 0 and len(lines) == 1, (rc, log[-3000:])
        for _ in range(50):  # the other node's processes end with their ssh session, a moment later
            left = rank_processes(killed)
            if not left:
                break
            time.sleep(0.1)
        assert not left, f"rank processes left after the job ended: {left}"
        say(f"rank 1 killed (SIGKILL) after step 3: the job exited {rc} {took:.1f} s later; {lines[0].strip()}")

        t = time.time()
        for late in (killed / "checkpoints").glob("step_*"):  # resume from step 2 wherever the kill landed
            if int(late.name.split("_")[1]) > 2:
                shutil.rmtree(late)
        run_train(CONFIG, killed, *OVERRIDES, "trainer.resume=auto", **nodes)
        n = assert_same_metrics(read_metrics(one), read_metrics(killed), "2 nodes (killed, resumed) vs 1 node")
        say(
            f"2 nodes x 1 rank, resumed across them from step 2 in {time.time() - t:.0f} s: steps 1-{STEPS}, "
            f"{n} metric values bitwise equal the 1-node run's"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    say(f"passed in {time.time() - t0:.0f} s")
    sys.exit(0)
