"""verl-ds vs TRL's GRPOTrainer on the same jobs, measured in one run; prints a Markdown table.

    source launch/env.sh && python benchmarks/side_by_side.py                       # both jobs, full length
    python benchmarks/side_by_side.py --jobs quickstart --steps quickstart=10        # a short check
    python benchmarks/side_by_side.py --jobs smollm2_tools --rounds 2               # the tool job (calculator)
(smollm2_tools is slow on TRL's side: one step took ~20 min with 2 threads on a shared 2-core box, so a
round of 3 steps x the two default TRL thread counts is ~2 h; --trl-threads 2 halves it.)

Runs in the project's .venv. For each job (benchmarks/trl_grpo.py JOBS: the example YAML plus the same
overrides on both sides): `bash launch/train.sh` (whole-process wall time; s/step = median
timing_s/step after the first step, rewards from the run's metrics.jsonl), then trl_grpo.py inside
benchmarks/.venv-trl (made by benchmarks/setup_trl.sh, called here; idempotent) once per TRL thread
count; with `--rounds N` that sequence N times, interleaved, and the table shows each side's median
(this host's speed drifted by 1.5x within an hour: one round can catch one side in a slow spell).
Writes <out>/results.json. Settings that differ between the sides: trl_grpo.py's docstring; on CPU
train.sh runs verl-ds on tcmalloc, TRL runs on glibc's malloc unless `--trl-tcmalloc`.
Ratio = TRL s/step / verl-ds s/step (> 1: verl-ds is faster); episodes/s = trainer.prompts_per_step x
rollout.n / s/step (an episode: one sampled answer, with all its turns in a tool job; results.json
also has tool calls per episode and per model turn for tool jobs). Both sides share the machine's cores:
run nothing else meanwhile, or the numbers say more about the neighbours than about the trainers.
TRL with more than one OpenMP thread is the most fragile: on a 2-core box shared with a 2-rank job,
OpenMP's active spin-wait made it 10 s/step on the quickstart instead of 0.39 s with
OMP_WAIT_POLICY=PASSIVE (set in the environment, it reaches both sides) or 0.32 s with one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_grpo import JOBS, job_config, num_ranks  # noqa: E402  (module-level: no TRL import)

from verl_ds.diagnostics.plots import read_metrics  # noqa: E402

TRL_PY = ROOT / "benchmarks" / ".venv-trl" / "bin" / "python"


def _mean(xs):
    return statistics.mean(xs) if xs else None


def episodes_per_step(job: str, extra: list[str]) -> int:
    """Episodes (sampled answers) a rollout step: trainer.prompts_per_step x rollout.n, as both sides run it."""
    cfg = job_config(job, None, extra)
    return cfg.trainer.prompts_per_step * cfg.rollout.n


def _tool_metrics(rows: list[dict]) -> dict:
    """verl-ds's tool-job metrics over the run: calls per model turn, per episode, turns per episode."""
    steps = [r for r in rows if "tools/call_frequency" in r and "multi_turn/turns/mean" in r]
    if not steps:
        return {}
    per_ep = [r["tools/call_frequency"] * r["multi_turn/turns/mean"] for r in steps]
    return {
        "tool_calls_per_episode": _mean(per_ep),
        "tool_calls_per_turn": _mean([r["tools/call_frequency"] for r in steps]),
        "tool_failures_per_call": _mean(
            [r["tools/failure_frequency"] for r in steps if "tools/failure_frequency" in r]
        ),
        "turns_per_episode": _mean([r["multi_turn/turns/mean"] for r in steps]),
        "tool_calls_per_episode_steps": per_ep,
    }


def run_verl_ds(job: str, steps: int, run_dir: Path, extra: list[str], log) -> dict:
    yaml, overrides, _, _ = JOBS[job]
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: builds its init model, no resume
    cmd = ["bash", "launch/train.sh", yaml, *overrides, f"trainer.steps={steps}", f"trainer.run_dir={run_dir}", *extra]
    ranks = num_ranks(job)
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // ranks))
    env = dict(os.environ, NUM_RANKS=str(ranks), OMP_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc:
        raise SystemExit(f"verl-ds {job} failed (exit {rc}); see {log.name}")
    rows = read_metrics(run_dir / "metrics.jsonl")
    step_s = [r["timing_s/step"] for r in rows if "timing_s/step" in r]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    s_per_step = statistics.median(step_s[1:] or step_s)
    episodes = episodes_per_step(job, extra)
    return {
        "side": "verl-ds",
        "job": job,
        "steps": len(step_s),
        "s_per_step": s_per_step,
        "first_step_s": step_s[0],
        "wall_s": wall,
        "episodes_per_step": episodes,
        "episodes_per_s": episodes / s_per_step,
        "reward_first5": _mean(rewards[:5]),
        "reward_last10": _mean(rewards[-10:]),
        "num_ranks": ranks,
        "threads": threads,
        **_tool_metrics(rows),
    }


def tcmalloc() -> str:
    """The tcmalloc launch/train.sh preloads into verl-ds's ranks on CPU ('' where none is installed)."""
    find = ["bash", "-c", "source launch/tcmalloc.sh && tcmalloc_path"]
    return subprocess.run(find, cwd=ROOT, capture_output=True, text=True).stdout.strip()


def run_trl(job: str, steps: int, threads: int, extra: list[str], log, preload: str = "") -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if preload:
        env["LD_PRELOAD"] = preload
    cmd = [str(TRL_PY), "benchmarks/trl_grpo.py", "--job", job, "--steps", str(steps), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    log.write(proc.stdout)
    log.flush()
    lines = [x for x in proc.stdout.splitlines() if x.startswith('{"side": "trl"')]
    if proc.returncode or not lines:
        raise SystemExit(f"TRL {job} failed (exit {proc.returncode}); see {log.name}")
    return {**json.loads(lines[-1]), "wall_s": wall, "wall_s_in_process": json.loads(lines[-1])["wall_s"]}


def _median(runs: list[dict]) -> dict:
    """One side's repeated runs as one row: median timings (each run's kept in *_runs), first rewards."""
    out = dict(runs[0], rounds=len(runs))
    for k in ("s_per_step", "wall_s"):
        out[f"{k}_runs"] = [r[k] for r in runs]
        out[k] = statistics.median(out[f"{k}_runs"])
    if out.get("episodes_per_step") and out["s_per_step"]:
        out["episodes_per_s"] = out["episodes_per_step"] / out["s_per_step"]
    return out


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def _threads(n: int) -> str:
    return f"{n} thread" + "s" * (n > 1)


def table(rows: list[tuple[dict, dict]]) -> str:
    out = [
        "| job | verl-ds s/step | TRL s/step | ratio (TRL/verl-ds) | verl-ds episodes/s | TRL episodes/s "
        "| verl-ds wall s | TRL wall s | verl-ds reward last10 | TRL reward last10 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v, t in rows:
        name = (
            f"{v['job']} ({v['steps']} steps; verl-ds {v['num_ranks']} ranks x {_threads(v['threads'])}, "
            f"TRL 1 process x {_threads(t['threads'])}; median of {v['rounds']} round(s))"
        )
        out.append(
            f"| {name} | {_f(v['s_per_step'])} | {_f(t['s_per_step'])} | "
            f"{_f(t['s_per_step'] / v['s_per_step'], '{:.2f}x')} | {_f(v.get('episodes_per_s'), '{:.2f}')} | "
            f"{_f(t.get('episodes_per_s'), '{:.2f}')} | {_f(v['wall_s'], '{:.1f}')} | "
            f"{_f(t['wall_s'], '{:.1f}')} | {_f(v['reward_last10'])} | {_f(t['reward_last10'])} |"
        )
    notes = [
        f"- {v['job']} (TRL {_threads(t['threads'])}): tool calls per episode verl-ds "
        f"{_f(v.get('tool_calls_per_episode'), '{:.2f}')}, TRL {_f(t.get('tool_calls_per_episode'), '{:.2f}')}; "
        f"per model turn {_f(v.get('tool_calls_per_turn'), '{:.2f}')} vs "
        f"{_f(t.get('tool_calls_per_turn'), '{:.2f}')}; "
        f"model turns per episode {_f(v.get('turns_per_episode'), '{:.2f}')} vs "
        f"{_f(t.get('turns_per_episode'), '{:.2f}')} (first round)"
        for v, t in rows
        if "tool_calls_per_episode" in v or "tool_calls_per_episode" in t
    ]
    return "\n".join(out + ([""] + notes if notes else []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", default=",".join(JOBS), help=f"comma list of {sorted(JOBS)}")
    ap.add_argument(
        "--steps",
        action="append",
        default=[],
        metavar="JOB=N",
        help="rollout steps for a job (default: " + ", ".join(f"{j}={s}" for j, (_, _, s, _) in JOBS.items()) + ")",
    )
    ap.add_argument(
        "--trl-threads",
        default=f"1,{os.cpu_count()}",
        help="TRL runs, one per OpenMP thread count (default: 1 and all cores)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="interleaved rounds (verl-ds, TRL, verl-ds, TRL, ...); the table shows medians",
    )
    ap.add_argument(
        "--trl-tcmalloc",
        action="store_true",
        help="TRL on tcmalloc too (launch/train.sh preloads it into verl-ds's ranks on CPU; TRL runs on glibc's)",
    )
    ap.add_argument("--out", default="runs/bench_trl", help="run dirs, logs and results.json")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides, passed to both sides")
    args = ap.parse_args()

    jobs = [j for j in args.jobs.split(",") if j]
    bad = set(jobs) - set(JOBS)
    if bad:
        ap.error(f"unknown job(s) {sorted(bad)}; known: {sorted(JOBS)}")
    steps = {j: s for j, (_, _, s, _) in JOBS.items()}
    for item in args.steps:
        j, _, n = item.partition("=")
        if j not in JOBS or not n.isdigit():
            ap.error(f"--steps wants JOB=N, got {item!r}")
        steps[j] = int(n)
    threads = sorted({int(x) for x in args.trl_threads.split(",") if x})

    subprocess.run(["bash", "benchmarks/setup_trl.sh"], cwd=ROOT, check=True)
    preload = tcmalloc() if args.trl_tcmalloc else ""
    if args.trl_tcmalloc and not preload:
        ap.error("--trl-tcmalloc: no libtcmalloc_minimal.so.4 installed (launch/install.sh installs it)")
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    if "smollm2_fewshot" in jobs:  # its data file: the few-shot prompts of benchmarks/shared_prefix.py
        from shared_prefix import write_data

        (ROOT / "runs/bench_trl").mkdir(parents=True, exist_ok=True)
        write_data(ROOT / "runs/bench_trl/fewshot.jsonl", 8, 1000)
    for job in jobs:
        runs: dict = {"verl-ds": [], **{k: [] for k in threads}}
        for i in range(args.rounds):  # interleaved: a slow spell of a shared host hits both sides
            with open(out / f"{job}.verl-ds.{i}.log", "w") as log:
                print(
                    f"[side_by_side] verl-ds {job}: {steps[job]} steps (round {i + 1}) ...", file=sys.stderr, flush=True
                )
                runs["verl-ds"].append(run_verl_ds(job, steps[job], out / job, args.overrides, log))
            print(f"[side_by_side]   {json.dumps(runs['verl-ds'][-1])}", file=sys.stderr, flush=True)
            for k in threads:
                with open(out / f"{job}.trl-{k}t.{i}.log", "w") as log:
                    print(
                        f"[side_by_side] TRL {job}: {steps[job]} steps, {k} thread(s) (round {i + 1}) ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    runs[k].append(run_trl(job, steps[job], k, args.overrides, log, preload))
                print(f"[side_by_side]   {json.dumps(runs[k][-1])}", file=sys.stderr, flush=True)
        rows += [(_median(runs["verl-ds"]), _median(runs[k])) for k in threads]
    (out / "results.json").write_text(json.dumps([{"verl_ds": v, "trl": t} for v, t in rows], indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
