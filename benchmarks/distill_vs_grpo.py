"""On-policy distillation vs GRPO from the same base, measured in one run.

    source launch/env.sh && python benchmarks/distill_vs_grpo.py --job smollm2     # ~2 h on 2 cores
    python benchmarks/distill_vs_grpo.py --job smollm2 --teacher-only   # the teacher alone (~35 min, cached)
    python benchmarks/distill_vs_grpo.py --job smollm2 --teacher-dtypes fp32 bf16 int8 --steps 3
    python benchmarks/distill_vs_grpo.py                 # the tiny task: 2 seeds, ~10 min
    python benchmarks/distill_vs_grpo.py --job smollm2 --seeds 2 --steps 4 --val-every 2   # a short check

`--job smollm2` (the real-model demo, `examples/grpo_cpu_smollm2_rg.yaml`: SmolLM2-135M-Instruct,
reasoning-gym two-digit arithmetic, scored by the package; `bash launch/demo.sh` converts the model):
1. The teacher: the demo's own recipe (GRPO, seed 1) for --teacher-steps (30), exported as an HF model
   and cached in --teacher-dir (`runs/teacher_smollm2_rg`): a later run reuses it (delete the folder
   to retrain). Its held-out greedy accuracy at its last step is the target.
2. For each seed, from the untrained SmolLM2 base: on-policy distillation alone (the teacher's
   per-token reverse KL as the reward, no task reward, no reference) and GRPO (the rule reward), the
   same prompts, sampling, learning rate and steps; greedy accuracy on the same held-out questions
   (`data.reasoning_gym.val_size` 600: 500+ after removing those seen in training) every --val-every
   steps. Every role fp32 on every CPU kind (the demo's measured recipe; `auto` would pick bf16 on
   avx512_bf16 hosts).
The tiny job (default): the quickstart's task, `examples/grpo_cpu_tiny.yaml` and `opd_cpu_tiny.yaml`
from a random-init model, 10 held-out problems (`data.val_fraction` 0.4).
Every run goes through `launch/train.sh` (smollm2: one rank with every core, as the demo; tiny: 2 ranks).
"Reached" = the first validation at >= teacher accuracy - 0.03; its time is the run's summed
`timing_s/step` up to it (training only: start-up and validation excluded). Writes <out>/results.json
and <out>/distill_vs_grpo.png; prints a Markdown table (with each step's phases per method).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["checkpoint.every=0", "logging.wandb.mode=disabled", "logging.sample_every=0"]
FP32 = [f"precision.{r}_dtype=fp32" for r in ("actor", "reference", "rollout", "teacher")]


@dataclass(frozen=True)
class Job:
    grpo: str  # GRPO's config in examples/
    distill: str  # distillation's config
    both: list[str]  # overrides of every run (teacher included)
    distill_only: list[str]
    acc: str  # the held-out greedy accuracy key
    env: dict[str, str]  # the launcher's environment
    defaults: dict  # argparse defaults of this job


JOBS = {
    "tiny": Job(
        "grpo_cpu_tiny.yaml",
        "opd_cpu_tiny.yaml",
        ["data.val_fraction=0.4"],
        [],
        "val/arithmetic/accuracy",
        {},
        {"seeds": [2, 3], "steps": 150, "teacher_steps": 200, "val_every": 10},
    ),
    "smollm2": Job(
        "grpo_cpu_smollm2_rg.yaml",
        "grpo_cpu_smollm2_rg.yaml",
        ["data.reasoning_gym.val_size=600", "trainer.val_n=1", "logging.memory_every=0", *FP32],
        [
            "algorithm.kl_coef=0",
            "algorithm.use_kl_loss=false",
            "algorithm.distill.coef=1.0",
            "roles.teacher.micro_batch_size=32",
        ],
        "val/reasoning_gym/accuracy",
        {"NUM_RANKS": "1", "OMP_NUM_THREADS": str(os.cpu_count())},
        {
            "seeds": [2, 3],
            "steps": 12,
            "teacher_steps": 30,
            "val_every": 2,
            "teacher_dir": str(ROOT / "runs" / "teacher_smollm2_rg"),
        },
    ),
}
ACC = "val/arithmetic/accuracy"


def train(config: str, run_dir: Path, overrides: list[str], env: dict[str, str]) -> list[dict]:
    """One run through the launcher (output in run_dir/train.log); its metrics rows."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["bash", str(ROOT / "launch" / "train.sh"), str(ROOT / "examples" / config), f"trainer.run_dir={run_dir}"]
    with open(run_dir / "train.log", "w") as log:
        t0 = time.perf_counter()
        rc = subprocess.run(
            cmd + COMMON + overrides, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **env}
        ).returncode
    if rc != 0:
        sys.exit(f"{config} failed (exit {rc}): see {run_dir / 'train.log'}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    rows.append({"wall_s": time.perf_counter() - t0})
    return rows


def curve(rows: list[dict]) -> dict:
    """Held-out accuracy per validation step with the training seconds up to it, and train reward."""
    secs, t, val = {}, 0.0, []
    for r in rows:
        if "timing_s/step" in r:
            t += r["timing_s/step"]
            secs[r["step"]] = t
    for r in rows:
        if ACC in r:
            val.append((r["step"], secs.get(r["step"], 0.0), r[ACC]))
    reward = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    steps = [r for r in rows if "timing_s/step" in r]
    phases = {
        k: sum(r.get(k, 0.0) for r in steps) / max(len(steps), 1)
        for k in sorted({k for r in steps for k in r if k.startswith("timing_s/")})
    }
    kl = [(r["step"], r[k]) for r in steps for k in r if k.startswith("distill/") and k.endswith("reverse_kl")]
    return {"val": val, "reward": reward, "wall_s": rows[-1]["wall_s"], "train_s": t, "phases": phases, "kl": kl}


def teacher_dtypes(job: Job, teacher_dir: Path, dtypes: list[str], steps: int, out: Path) -> int:
    """Distillation runs that differ only in the teacher's dtype: the same student (fp32), prompts and seeds,
    so step 1's samples are the same and the KL the teacher gives differs by the teacher's rounding alone."""
    rows = {}
    for dt in dtypes:
        over = [
            f"model.teacher_path={teacher_dir / 'final_model'}",
            *job.distill_only,
            *job.both,
            f"precision.teacher_dtype={dt}",
            f"trainer.steps={steps}",
            "trainer.seed=2",
            "trainer.val_every=0",
            "trainer.val_before_train=false",
            "logging.memory_every=1",
        ]
        rows[dt] = [r for r in train(job.distill, out / f"teacher_{dt}", over, job.env) if "timing_s/step" in r]
    base = rows[dtypes[0]][0]["distill/reverse_kl/mean"]
    lines = [
        f"Teacher dtypes: {steps} distillation steps each from the same student; KL at step 1 (same samples).",
        "",
        "| teacher dtype | teacher memory (MiB) | teacher pass s/step | step s | reverse KL step 1 | "
        f"vs {dtypes[0]} | reverse KL last |",
        "|---|---|---|---|---|---|---|",
    ]
    for dt, rs in rows.items():
        mem = max(r.get("memory/score/teacher/total_mib", float("nan")) for r in rs)
        t_s = sum(r.get("timing_s/teacher", 0.0) for r in rs) / len(rs)
        step_s = sum(r["timing_s/step"] for r in rs) / len(rs)
        kl1, kl_last = rs[0]["distill/reverse_kl/mean"], rs[-1]["distill/reverse_kl/mean"]
        lines.append(f"| {dt} | {mem:.0f} | {t_s:.2f} | {step_s:.1f} | {kl1:.5f} | {kl1 - base:+.2e} | {kl_last:.4f} |")
    print("\n".join(lines))
    (out / "teacher_dtypes.json").write_text(json.dumps(rows, indent=1))
    return 0


def reached(c: dict, target: float):
    return next(((s, sec) for s, sec, acc in c["val"] if acc >= target - 1e-9), (None, None))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=sorted(JOBS), default="tiny")
    ap.add_argument("--seeds", type=int, nargs="+")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--teacher-steps", type=int)
    ap.add_argument("--val-every", type=int)
    ap.add_argument(
        "--teacher-dir", help="the teacher's run folder, reused once it holds final_model (default: <out>/teacher)"
    )
    ap.add_argument(
        "--teacher-dtypes",
        nargs="+",
        help="instead of the comparison: distillation from the teacher held in each dtype (fp32 bf16 int8 ...), "
        "--steps steps each from the same student and samples: the teacher's memory and seconds, and the KL it gives",
    )
    ap.add_argument("--teacher-only", action="store_true", help="train (or find) the teacher, print its accuracy, stop")
    ap.add_argument("--out", default=str(ROOT / "runs" / "distill_vs_grpo"))
    args = ap.parse_args()
    global ACC
    job = JOBS[args.job]
    for k, v in job.defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    ACC = job.acc
    out = Path(args.out if args.out != ap.get_default("out") else f"{args.out}_{args.job}")
    val = [f"trainer.val_every={args.val_every}", *job.both]
    teacher_dir = Path(args.teacher_dir) if args.teacher_dir else out / "teacher"
    if (teacher_dir / "final_model" / "config.json").exists() and (teacher_dir / "metrics.jsonl").exists():
        print(f"teacher: reusing {teacher_dir / 'final_model'}")
        t_rows = [json.loads(x) for x in (teacher_dir / "metrics.jsonl").read_text().splitlines() if x]
        t_rows.append({"wall_s": float("nan")})
    else:
        t_val = [f"trainer.val_every={min(10, args.teacher_steps)}", *job.both]
        t_rows = train(
            job.grpo, teacher_dir, [f"trainer.steps={args.teacher_steps}", "trainer.seed=1", *t_val], job.env
        )
    if args.teacher_dtypes:
        return teacher_dtypes(job, teacher_dir, args.teacher_dtypes, args.steps, out)
    teacher = curve(t_rows)
    t_acc = teacher["val"][-1][2]
    if args.teacher_only:
        print(
            f"teacher {teacher_dir / 'final_model'}: held-out greedy accuracy "
            + ", ".join(f"step {st}: {a:.3f}" for st, _, a in teacher["val"])
        )
        return 0
    target = t_acc - 0.03
    runs = {}
    for seed in args.seeds:  # the two methods one after the other per seed: drift hits both alike
        common = [f"trainer.steps={args.steps}", f"trainer.seed={seed}", *val]
        opd = [f"model.teacher_path={teacher_dir / 'final_model'}", *job.distill_only, *common]
        runs[f"distill/{seed}"] = curve(train(job.distill, out / f"distill_{seed}", opd, job.env))
        runs[f"grpo/{seed}"] = curve(train(job.grpo, out / f"grpo_{seed}", common, job.env))
    phase_keys = sorted({k for c in runs.values() for k in c["phases"]})
    rows = []
    for name, c in runs.items():
        step, sec = reached(c, target)
        best = max(a for _, _, a in c["val"])
        last_r = [v for _, v in c["reward"][-10:]]
        rows.append(
            f"| {name} | {step if step is not None else 'not reached'} | "
            f"{f'{sec:.1f}' if sec is not None else '-'} | {c['val'][-1][2]:.2f} | {best:.2f} | "
            f"{sum(last_r) / len(last_r):.3f} | {c['train_s'] / max(len(c['reward']), 1):.3f} | {c['wall_s']:.0f} |"
        )
    table = "\n".join(
        [
            f"Job {args.job}. Teacher (GRPO, seed 1, {args.teacher_steps} steps): held-out greedy accuracy "
            f"{t_acc:.3f} (step 0: {teacher['val'][0][2]:.3f}); target {target:.3f}. {args.steps} steps per run, "
            f"{os.cpu_count()} cores.",
            "",
            "| run / seed | steps to target | train s to target | final held-out | best held-out | "
            "train reward (last 10) | s/step | run wall s |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            "Held-out greedy accuracy per validation step:",
            "",
            *(f"- {n}: " + ", ".join(f"{st}: {a:.3f}" for st, _, a in c["val"]) for n, c in runs.items()),
            "",
            "Seconds per step, each phase (mean over the run's steps):",
            "",
            "| run / seed | " + " | ".join(k.removeprefix("timing_s/") for k in phase_keys) + " |",
            "|---|" + "---|" * len(phase_keys),
            *(
                f"| {n} | " + " | ".join(f"{c['phases'].get(k, 0.0):.2f}" for k in phase_keys) + " |"
                for n, c in runs.items()
            ),
        ]
    )
    print(table)
    (out / "results.json").write_text(json.dumps({"teacher": teacher, "target": target, "runs": runs}, indent=1))
    from verl_ds.diagnostics.plots import save_panels

    style = {"grpo": {"linestyle": "--"}, "distill": {}}
    panels = [
        (
            "held-out accuracy",
            [
                (n, [s for s, _, _ in c["val"]], [a for *_, a in c["val"]], style[n.split("/")[0]])
                for n, c in runs.items()
            ],
        ),
        (
            "held-out accuracy",
            [
                (n, [t for _, t, _ in c["val"]], [a for *_, a in c["val"]], style[n.split("/")[0]])
                for n, c in runs.items()
            ],
        ),
        (
            "train reward (task)",
            [
                (n, [s for s, _ in c["reward"]], _smooth([v for _, v in c["reward"]]), style[n.split("/")[0]])
                for n, c in runs.items()
            ],
        ),
    ]
    for _, lines in panels[:2]:
        lines.append(
            (f"teacher {t_acc:.2f}", [0, max(lines[0][1])], [t_acc, t_acc], {"color": "grey", "linestyle": ":"})
        )
    png = save_panels(panels, out / "distill_vs_grpo.png", xlabels=["step", "training seconds", "step"])
    print(f"\nwrote {out / 'results.json'} and {png}")
    return 0


def _smooth(v: list[float], w: int = 10) -> list[float]:
    return [sum(v[max(0, i - w + 1) : i + 1]) / len(v[max(0, i - w + 1) : i + 1]) for i in range(len(v))]


if __name__ == "__main__":
    sys.exit(main())
