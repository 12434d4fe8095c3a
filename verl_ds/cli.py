"""`verl-ds train | config render | bench … | debug memory | --version`.

User mistakes (ConfigError) print one line `error: <where>: <message>` and exit 2. A training rank
whose peers went away (kill -9, a node down) prints one line naming the ranks that are gone and
exits 1, so the launcher ends the job instead of it waiting in a collective.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import yaml

from verl_ds import __version__
from verl_ds.errors import ConfigError, RunFailure
from verl_ds.process import log_to_console


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other user mistake
        self.exit(2, f"error: {self.prog}: {message}\n")


def _positive(kind):
    """An argparse type: a number > 0 (a bad one is the parser's one-line error)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


POS_INT, POS_FLOAT = _positive(int), _positive(float)


def build_parser() -> argparse.ArgumentParser:
    """(Long on purpose: the command line's table, one subcommand after another.)"""
    p = _Parser(prog="verl-ds", description="RL post-training for LLMs on DeepSpeed")
    p.add_argument("--version", action="version", version=f"verl-ds {__version__}")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    train = sub.add_parser("train", help="train with PPO/GRPO/RLOO/REINFORCE++")
    train.add_argument("--config", required=True)
    train.add_argument("overrides", nargs="*", help="dotted overrides: key.sub=value")

    config = sub.add_parser("config", help="inspect a run config")
    csub = config.add_subparsers(dest="config_command", parser_class=_Parser, required=True)
    render = csub.add_parser(
        "render", help="check the config as a start would, then print it resolved and every role's DeepSpeed JSON"
    )
    render.add_argument("--config", required=True)
    render.add_argument("--world-size", type=POS_INT, default=None)
    render.add_argument(
        "--allow-absent",
        action="store_true",
        help="list the model and data paths absent on this machine instead of refusing them (a config for another)",
    )
    render.add_argument("overrides", nargs="*")
    csub.add_parser("docs", help="print every config key (type, default, allowed values, help) as Markdown")

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", parser_class=_Parser, required=True)
    rollout = bsub.add_parser("rollout", help="vLLM vs HF generate tokens/s, and sync vs train-step time")
    rollout.add_argument("--config", required=True)
    rollout.add_argument("overrides", nargs="*")
    step = bsub.add_parser("step", help="per-phase step time, tokens/s, MFU, and a plain-PyTorch floor")
    step.add_argument("--config", required=True)
    step.add_argument("--steps", type=POS_INT, default=5)
    step.add_argument("overrides", nargs="*")
    prec = bsub.add_parser(
        "precision", help="the same training under fp32/bf16/fp16: memory, speed, reward, loss scale"
    )
    prec.add_argument("--config", required=True)
    prec.add_argument("--dtypes", default="fp32,bf16,fp16")
    prec.add_argument(
        "--matrix", action="store_true", help="every trainer dtype x rollout dtype pair of --dtypes (9 cells for 3)"
    )
    prec.add_argument(
        "--cells",
        default=None,
        help="only these cells, e.g. fp32,bf16,fp16,fp32/bf16 (trainer/rollout); overrides --dtypes",
    )
    prec.add_argument("--steps", type=POS_INT, default=5)
    prec.add_argument("--out", default=None, help="output folder (default: <trainer.run_dir>/bench_precision)")
    prec.add_argument("overrides", nargs="*")

    debug = sub.add_parser("debug", help="diagnostics")
    dsub = debug.add_subparsers(dest="debug_command", parser_class=_Parser, required=True)
    mem = dsub.add_parser("memory", help="memory per stage and role: analytic estimate vs measured")
    mem.add_argument("--config", help="run config (with --compare: optional, unused)")
    mem.add_argument("--stage", default="all", choices=("all", "rollout", "train", "score", "update", "sync"))
    mem.add_argument("--model-config", help="an HF config.json: estimate only, nothing is built")
    mem.add_argument("--world-size", type=POS_INT, default=None)
    mem.add_argument("--gpu-memory-gb", type=POS_FLOAT, default=None, help="print a fits / doesn't-fit verdict")
    mem.add_argument("--compare", nargs=2, metavar=("A_YAML", "B_YAML"), help="Markdown delta of two configs")
    mem.add_argument("--metric", default="peak_memory", choices=("peak_memory", "rollout", "score", "update", "sync"))
    mem.add_argument(
        "--plan", action="store_true", help="search the placements that fit --world-size x --gpu-memory-gb"
    )
    mem.add_argument("--critic-config", help="--plan: the critic's HF config.json (default: --model-config)")
    mem.add_argument("--reward-config", help="--plan: a reward model's HF config.json (adds the reward role)")
    mem.add_argument("--host-memory-gb", type=POS_FLOAT, default=None, help="--plan: host memory per node")
    mem.add_argument("--top", type=POS_INT, default=8, help="--plan: plans printed")
    mem.add_argument(
        "--generation-share",
        type=float,
        default=None,
        help="--plan: the share of a colocated step spent generating (timing_s/rollout over timing_s/step), "
        "to weigh rollout ranks apart against colocated",
    )
    mem.add_argument(
        "--row-tokens",
        type=POS_INT,
        default=None,
        help="the longest row (prompt + response): sets rollout.max_model_len and the response budget "
        "(rollout.max_new_tokens = it - data.max_prompt_length)",
    )
    mem.add_argument("overrides", nargs="*")
    prec = dsub.add_parser(
        "precision", help="per role: value ranges and what fp32/bf16/fp16 would do; a recommended precision: block"
    )
    prec.add_argument("--config", required=True)
    prec.add_argument("--steps", type=POS_INT, default=3)
    prec.add_argument("--out", default=None, help="output folder (default: <trainer.run_dir>/debug_precision)")
    prec.add_argument("overrides", nargs="*")
    return p


def cmd_config(args) -> int:
    if args.config_command == "docs":
        from verl_ds.config import config_reference

        print(config_reference(), end="")
        return 0
    return cmd_render(args)


def cmd_render(args) -> int:
    """The run config, its precision and every role's DeepSpeed JSON after the checks a start makes before
    any engine (`config.validate`, the paths, the data files, `preflight`): what this prints, `train`
    starts; what it refuses, `train` refuses in the same lines. `--allow-absent`: a model or data path
    absent on this machine is listed, not refused (what is here is still checked)."""
    from verl_ds.config import load_config, sequence_parallel_says, to_dict, validate_paths
    from verl_ds.data.tasks import check_data_files
    from verl_ds.dist import on_gpu
    from verl_ds.ds_config import render_ds_configs, run_precision
    from verl_ds.errors import raise_all
    from verl_ds.preflight import preflight

    cfg = load_config(args.config, args.overrides, args.world_size)
    absent = validate_paths(cfg, missing_ok=args.allow_absent)
    raise_all(check_data_files(cfg.data))  # what train would refuse of the files that are here
    engine = preflight(cfg, on_gpu()).engine
    precision = run_precision(cfg)
    rendered = render_ds_configs(cfg, args.world_size, precision)
    print("# run config (as given; `auto` resolves to the precision below)")
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip())
    if engine != cfg.rollout.engine:
        print(f"# rollout.engine {cfg.rollout.engine} -> {engine} on this machine")
    if said := sequence_parallel_says(cfg):
        print(f"# {said}")
    resolved = {k: v for k, v in vars(precision).items() if not k.endswith("loss_scaling")}
    print("\n# precision (resolved on this machine)")
    print(yaml.safe_dump(resolved, sort_keys=False).rstrip())
    unresolved = [f"{key}: {msg} (a run stops here)" for key, msg in (a.split(": ", 1) for a in absent)]
    for role in rendered:
        if getattr(cfg.roles, role).zero_stage == "auto":
            stage = rendered[role].get("zero_optimization", {}).get("stage", 0)
            unresolved.append(
                f"roles.{role}.zero_stage: auto is chosen at start from the model and the GPU memory; "
                f"shown: the JSON's stage {stage}"
            )
    if unresolved:
        print("\n# not resolved on this machine")
        print("\n".join(f"#   {line}" for line in unresolved))
    for role, ds in rendered.items():
        print(f"\n# {role}: DeepSpeed config")
        print(json.dumps(ds, indent=2))
    return 0


def cmd_train(args) -> int:
    from verl_ds.config import load_config
    from verl_ds.trainer import train

    cfg = load_config(args.config, args.overrides)
    train(cfg, exiting=args.exiting)
    return 0


def cmd_bench(args) -> int:
    from verl_ds.config import load_config

    if args.bench_command == "precision":
        return cmd_bench_precision(args)
    if args.bench_command == "step":
        from verl_ds.programs.bench_step import bench_step

        cfg = load_config(
            args.config,
            args.overrides + ["logging.wandb.mode=disabled", "trainer.val_every=0", "trainer.val_before_train=false"],
        )
        bench_step(cfg, args.steps)
        return 0
    from verl_ds.programs.bench import bench_rollout

    bench_rollout(load_config(args.config, args.overrides))
    return 0


def cmd_bench_precision(args) -> int:
    from pathlib import Path

    from verl_ds.config import load_config
    from verl_ds.programs.bench_precision import bench_precision, parse_cells, parse_dtypes

    dtypes = parse_dtypes(args.dtypes)
    only = parse_cells(args.cells) if args.cells is not None else None
    out = args.out or str(Path(load_config(args.config, args.overrides).trainer.run_dir) / "bench_precision")
    res = bench_precision(args.config, args.overrides, dtypes, args.steps, out, matrix=args.matrix, only=only)
    print(res["table"])
    print(f"\nwrote {out}/bench_precision.md, .json, .png")
    return 0


def cmd_debug(args) -> int:
    """`debug memory`: estimate (+ measured from one real step unless --model-config), or --compare."""
    if args.debug_command == "precision":
        return cmd_debug_precision(args)
    from pathlib import Path

    from verl_ds.config import load_config, validate_paths
    from verl_ds.data.tiny import prepare_model
    from verl_ds.diagnostics import memory
    from verl_ds.ds_config import render_ds_configs, run_precision

    def shape_of(cfg):
        if args.model_config:
            return memory.load_shape(args.model_config)
        validate_paths(cfg)
        return memory.load_shape(str(Path(prepare_model(cfg.model, cfg.trainer.run_dir)) / "config.json"))

    world = args.world_size or 1
    if args.row_tokens and args.config:
        args.overrides = args.overrides + _row_overrides(load_config(args.config, args.overrides), args.row_tokens)
    if args.plan:
        return _debug_memory_plan(args, world)
    if args.compare:
        tables = []
        for path in args.compare:
            cfg = load_config(path, args.overrides)
            precision = run_precision(cfg)
            est = memory.estimate_memory(
                cfg,
                shape_of(cfg),
                render_ds_configs(cfg, world, precision),
                world,
                precision.rollout,
                args.gpu_memory_gb,
                memory.role_shapes(cfg),
            )
            tables.append(memory.peak_by_role(est) if args.metric == "peak_memory" else est[args.metric])
        print(f"## {args.metric}: {args.compare[0]} vs {args.compare[1]} (analytic estimate, world size {world})\n")
        print(memory.compare_table(*tables, names=tuple(Path(p).stem for p in args.compare)))
        return 0
    if not args.config:
        raise ConfigError("--config", "debug memory needs --config X.yaml (or --compare A.yaml B.yaml)")
    cfg = load_config(args.config, args.overrides)
    measured = None
    if not args.model_config:  # build the real roles and measure one step (own run dir, no W&B)
        cfg = load_config(
            args.config,
            args.overrides
            + ["logging.wandb.mode=disabled", f"trainer.run_dir={Path(cfg.trainer.run_dir) / 'debug_memory'}"],
        )
        from verl_ds.programs.debug_memory import measure_step

        measured, ran_world = measure_step(cfg)
        world = args.world_size or ran_world
    print(memory.report(cfg, shape_of(cfg), world, args.stage, measured, args.gpu_memory_gb))
    return 0


def _row_overrides(cfg, tokens: int) -> list[str]:
    """`--row-tokens`: rows of up to `tokens` tokens, the prompt as the config cuts it, the rest response."""
    prompt = cfg.data.max_prompt_length
    if tokens <= prompt:
        raise ConfigError("--row-tokens", f"{tokens} leaves no response after data.max_prompt_length {prompt}")
    return [f"rollout.max_model_len={tokens}", f"rollout.max_new_tokens={tokens - prompt}"]


def _debug_memory_plan(args, world: int) -> int:
    """`debug memory --plan`: every placement that fits, cheapest first, and the best as YAML."""
    from pathlib import Path

    from verl_ds.config import load_config
    from verl_ds.diagnostics import memory
    from verl_ds.diagnostics.memory import plan
    from verl_ds.ds_config import render_ds_configs, run_precision

    for flag, value in (("--config", args.config), ("--model-config", args.model_config)):
        if not value:
            raise ConfigError(flag, "debug memory --plan needs --config X.yaml --model-config M/config.json")
    if not args.gpu_memory_gb:
        raise ConfigError("--gpu-memory-gb", "debug memory --plan needs the GPU size")
    extra = [f"model.reward_path={Path(args.reward_config).parent}"] if args.reward_config else []
    cfg = load_config(args.config, args.overrides + extra, world_size=world)
    actor = memory.load_shape(args.model_config)
    shapes = {"actor": actor, "reference": actor, "critic": memory.load_shape(args.critic_config or args.model_config)}
    if args.reward_config:
        shapes["reward"] = memory.load_shape(args.reward_config)
    g = args.generation_share
    if g is not None and not 0 < g < 1:
        raise ConfigError("--generation-share", f"{g} is not a share of the step: between 0 and 1")
    precision = run_precision(cfg)

    def render(c, ranks: int) -> dict:
        return render_ds_configs(c, ranks, precision)

    gpu, host = args.gpu_memory_gb, args.host_memory_gb
    plans = plan.search(cfg, shapes, render(cfg, world), world, gpu, host)
    print(plan.render_plans(plans, args.top, world, gpu, host))
    if world > 1 and not cfg.trainer.rollout_ranks:  # against splitting the same GPUs
        if g is None:
            print(
                "\nRollout ranks apart (`trainer.rollout_ranks`) are weighed against these with --generation-share "
                "(a colocated run's timing_s/rollout over timing_s/step)."
            )
        else:
            print("\n" + plan.render_apart(plan.weigh_apart(cfg, shapes, render, world, gpu, host, g), world, g))
    return 0


def cmd_debug_precision(args) -> int:
    """`debug precision`: N real steps with every role probed; table, recommendations, precision.yaml."""
    from verl_ds.programs.precision_advisor import debug_precision

    res = debug_precision(args.config, args.overrides, args.steps, args.out)
    print(res["report"])
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.exiting = argv is None  # a program (not a call from Python): the process ends after the command
    if args.exiting and "" not in sys.path and os.getcwd() not in sys.path:
        # as `python -m` (launch/train.sh, the ranks) does: a reward function, agent or environment the
        # config names imports from the directory the command runs in (the `verl-ds` script omits it)
        sys.path.insert(0, os.getcwd())
    log_to_console()
    # torch.distributed's deprecation notices for calls DeepSpeed makes: not actionable by users
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    handlers = {"train": cmd_train, "config": cmd_config, "bench": cmd_bench, "debug": cmd_debug}
    if args.command is None:
        build_parser().print_help()
        return 2
    try:
        rc = handlers[args.command](args)
    except ConfigError as e:
        for err in e.errors:
            print(f"error: {err}", file=sys.stderr)
        rc = 2
    except RunFailure as e:
        print(f"error: {e}", file=sys.stderr)
        rc = 1
    except Exception as e:
        from verl_ds.dist import lost_peer_line

        line = lost_peer_line(e) if args.command == "train" else None
        if line is None:  # not a peer gone: this rank's own error, with its traceback
            raise
        print(f"error: {line}", file=sys.stderr)
        rc = 1
    if args.exiting and args.command == "train":
        _exit_now(rc)
    return rc


def _exit_now(rc: int) -> None:
    """End a training process without the interpreter's teardown: freeing a heap of torch,
    transformers, vLLM and DeepSpeed objects one by one took 2-4 s per rank, and the OS frees it at
    once. Exit handlers still run first (logging, W&B, DeepSpeed's shm buffer); files are closed."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
