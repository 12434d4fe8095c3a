"""Where each rank is, for the launcher to name when a rank dies without a word.

The kernel's OOM killer ends a process with SIGKILL: no handler runs, nothing is logged, and the
console's last lines are the launcher's. So each rank keeps a small JSON file of where it is (step,
phase, stage, the memory model's estimate for that stage, the last good checkpoint) in the folder the
launcher names (`VERL_DS_STATUS_DIR`), replaced atomically at each phase; the launcher reads the dead
rank's file and writes the one line (`death_line`). Without the variable (a run not started by
`verl_ds.launcher`) nothing is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "VERL_DS_STATUS_DIR"
GIB = 2**30


class Progress:
    """This rank's file: `at` each phase, `checkpoint` after each save."""

    def __init__(
        self, rank: int, run_dir: str, estimate: dict[str, float], budget: float, checkpoint: str | None = None
    ):
        """`estimate`: the memory model's bytes per stage for one rank; `budget`: the rank's memory;
        `checkpoint`: the one the run resumes from (the last good one until the run saves its own)."""
        folder = os.environ.get(ENV)
        self.path = Path(folder) / f"rank{rank}.json" if folder else None
        self.state = {
            "rank": rank,
            "run_dir": run_dir,
            "step": 0,
            "phase": "setup",
            "stage": None,
            "estimate_gib": {k: round(v / GIB, 2) for k, v in estimate.items()},
            "budget_gib": round(budget / GIB, 1),
            "checkpoint": checkpoint,
        }
        self._write()

    def at(self, step: int, phase: str, stage: str | None) -> None:
        """Entering `phase` (of `stage`) of step `step` (1-based: the step in progress)."""
        self.state.update(step=step, phase=phase, stage=stage)
        self._write()

    def checkpoint(self, path: str | None) -> None:
        self.state["checkpoint"] = path
        self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.state))
            os.replace(tmp, self.path)
        except OSError:  # a diagnostic: never fails the run
            pass


def read(folder: str | Path, rank: int) -> dict | None:
    try:
        return json.loads((Path(folder) / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def death_line(rank: int, pid: int, signum: int, oom: str | None, status: dict | None) -> str:
    """One line for a rank that a signal ended: which rank, the likely cause, where it was, what the
    memory model expected there, the last good checkpoint."""
    import signal

    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    line = f"rank {rank} (pid {pid}) was killed by {name}" if rank >= 0 else f"a rank was killed by {name}"
    if signum == signal.SIGKILL:
        line += f": the kernel's OOM killer ({oom})" if oom else ": most likely the kernel's OOM killer (out of memory)"
    if status:
        where = f"step {status['step']}, phase {status['phase']}" if status["phase"] != "setup" else "its setup"
        line += f"; it was in {where}"
        est = status.get("estimate_gib", {}).get(status.get("stage") or "")
        if est is not None:
            line += f" (the memory model's estimate for its {status['stage']} stage: {est:g} GiB"
            line += f" of this rank's {status['budget_gib']:g} GiB)"
        ckpt = status.get("checkpoint")
        line += f"; last good checkpoint: {ckpt} (trainer.resume=auto)" if ckpt else "; no checkpoint saved yet"
    if signum == signal.SIGKILL:
        line += "; `verl-ds debug memory --config ...` shows where the memory goes"
    return line
