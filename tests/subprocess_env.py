"""The environment for a test's child process (CLI, launcher, fresh pytest): this test process's own
process-group variables are dropped, since its MASTER_PORT is taken and a child must form its own."""

import os

DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in DIST_VARS}, **extra}
