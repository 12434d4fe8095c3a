"""`python -m verl_ds.train.ppo` (or `deepspeed --module verl_ds.train.ppo`): familiar flags mapped
onto the run config, then the same trainer as `verl-ds train`."""

from __future__ import annotations

import argparse
import sys

from verl_ds.errors import ConfigError
from verl_ds.process import log_to_console


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m verl_ds.train.ppo", description="PPO/GRPO training on DeepSpeed (see verl-ds train)")
    p.add_argument("--config", default=None, help="YAML run config (defaults apply without one)")
    p.add_argument("--model_name_or_path", default=None, help="HF model directory -> model.path")
    p.add_argument(
        "--rollout_batch_size", type=_positive, default=None, help="prompts per step -> trainer.prompts_per_step"
    )
    p.add_argument(
        "--train_batch_size", type=_positive, default=None, help="samples per optimizer step -> trainer.mini_batch_size"
    )
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="dotted overrides: key.sub=value")
    return p


def to_overrides(args) -> list[str]:
    mapped = {
        "model.path": args.model_name_or_path,
        "trainer.prompts_per_step": args.rollout_batch_size,
        "trainer.mini_batch_size": args.train_batch_size,
    }
    return [f"{k}={v}" for k, v in mapped.items() if v is not None] + list(args.overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_to_console()
    try:
        from verl_ds.config import load_config
        from verl_ds.trainer import train

        train(load_config(args.config, to_overrides(args)))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
