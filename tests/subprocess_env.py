"""The environment for a test's child process (CLI, launcher, fresh pytest): this test process's own
process-group variables are dropped, since its MASTER_PORT is taken and a child must form its own."""

import os
import subprocess
import sys

DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_cli(*args: str, cwd=None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m verl_ds.cli ARGS` in a child process (its own process group variables), captured."""
    return subprocess.run(
        [sys.executable, "-m", "verl_ds.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=child_env(),
        timeout=timeout,
    )


def child_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in DIST_VARS}, **extra}
