"""`verl-ds train | config render | bench … | --version`.

User mistakes (ConfigError) print one line `error: <where>: <message>` and exit 2.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

import yaml

from verl_ds import __version__
from verl_ds.errors import ConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other user mistake
        self.exit(2, f"error: {self.prog}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="verl-ds", description="RL post-training for LLMs on DeepSpeed")
    p.add_argument("--version", action="version", version=f"verl-ds {__version__}")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    train = sub.add_parser("train", help="train with PPO/GRPO/RLOO/REINFORCE++")
    train.add_argument("--config", required=True)
    train.add_argument("overrides", nargs="*", help="dotted overrides: key.sub=value")

    config = sub.add_parser("config", help="inspect a run config")
    csub = config.add_subparsers(dest="config_command", parser_class=_Parser, required=True)
    render = csub.add_parser("render", help="print the resolved run config and every role's DeepSpeed JSON")
    render.add_argument("--config", required=True)
    render.add_argument("--world-size", type=int, default=None)
    render.add_argument("overrides", nargs="*")

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", parser_class=_Parser, required=True)
    rollout = bsub.add_parser("rollout", help="vLLM vs HF generate tokens/s, and sync vs train-step time")
    rollout.add_argument("--config", required=True)
    rollout.add_argument("overrides", nargs="*")
    return p


def cmd_render(args) -> int:
    from verl_ds.config import load_config, render_ds_configs, to_dict

    cfg = load_config(args.config, args.overrides)
    rendered = render_ds_configs(cfg, args.world_size)
    print("# run config (resolved)")
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip())
    for role, ds in rendered.items():
        print(f"\n# {role}: DeepSpeed config")
        print(json.dumps(ds, indent=2))
    return 0


def cmd_train(args) -> int:
    from verl_ds.config import load_config
    from verl_ds.trainer import train

    cfg = load_config(args.config, args.overrides)
    train(cfg)
    return 0


def cmd_bench(args) -> int:
    from verl_ds.config import load_config
    from verl_ds.diagnostics.bench import bench_rollout

    bench_rollout(load_config(args.config, args.overrides))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[verl-ds] %(message)s", stream=sys.stdout)
    handlers = {"train": cmd_train, "config": cmd_render, "bench": cmd_bench}
    if args.command is None:
        build_parser().print_help()
        return 2
    try:
        return handlers[args.command](args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
