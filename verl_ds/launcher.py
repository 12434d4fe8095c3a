"""`python -m verl_ds.launcher --num_ranks N --master_port P -- SCRIPT_ARGS...`: one node, no hostfile.

Runs DeepSpeed's per-node launcher (`deepspeed.launcher.launch`: the process that spawns the ranks,
sets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR, forwards SIGINT/SIGTERM and kills the ranks when one
fails) in this process, with the world the `deepspeed` runner would hand it for `--num_gpus N` on
localhost. On one node the runner only builds that world and starts the launcher, so skipping it
saves its own import of deepspeed and torch and two interpreter teardowns: ~3-4 s a run on 2 CPU
cores. Multi-node runs (a hostfile) go through the `deepspeed` runner.
"""
from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m verl_ds.launcher")
    p.add_argument("--num_ranks", type=int, required=True)
    p.add_argument("--master_port", type=int, required=True)
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- then what follows `deepspeed [opts]`")
    args = p.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if args.num_ranks < 1 or not script:
        p.error("--num_ranks must be >= 1 and a script (or --module M) must follow --")

    from deepspeed.launcher import launch
    from deepspeed.launcher.runner import encode_world_info

    world = encode_world_info({"localhost": list(range(args.num_ranks))})
    sys.argv = ["deepspeed.launcher.launch", f"--world_info={world}", "--master_addr=127.0.0.1",
                f"--master_port={args.master_port}", *script]
    try:
        launch.main()
        rc = 0
    except SystemExit as e:   # a rank failed or a signal arrived: the launcher has already cleaned up
        rc = e.code if isinstance(e.code, int) else int(e.code is not None)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)              # the ranks are gone; skip the ~1 s teardown of an interpreter holding torch


if __name__ == "__main__":
    main()
