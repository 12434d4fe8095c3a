"""On-policy distillation vs GRPO from the same base, on the quickstart's task, measured in one run.

    source launch/env.sh && python benchmarks/distill_vs_grpo.py                 # 2 seeds, ~10 min on 2 cores
    python benchmarks/distill_vs_grpo.py --seeds 2 --steps 60 --teacher-steps 100  # a short check
    python benchmarks/distill_vs_grpo.py --job smollm2 --seeds 1 2 --steps 16 --teacher-steps 16 --val-every 8

1. The teacher: `examples/grpo_cpu_tiny.yaml` (GRPO, seed 1) for --teacher-steps; its final model and
   its held-out greedy accuracy at the last step.
2. For each seed, from the same random-init student (`model.path: tiny`, `model.tiny.seed` 0, as the
   teacher's own start): GRPO (`grpo_cpu_tiny.yaml`) and distillation alone
   (`examples/opd_cpu_tiny.yaml`: the teacher's per-token reverse KL as the reward, no task reward),
   the same rollout budget (steps x prompts x samples) and learning rate.
`--job smollm2`: the same on the real-model demo (`examples/grpo_cpu_smollm2_rg.yaml`: SmolLM2-135M-
Instruct, reasoning-gym arithmetic, its held-out questions; `bash launch/demo.sh` converts the model
once); distillation keeps the demo's settings, without the reference. With `--seeds 1 ...` GRPO's
seed-1 run is the teacher's own.
Every run goes through `launch/train.sh` (2 ranks). Held-out accuracy: greedy, on 10 prompts the
training never sees (`data.val_fraction` 0.4 of the 25 problems; every run holds out the same ones),
every --val-every steps. "Reached" = the first validation at >= teacher accuracy - 0.03; its time is
the run's summed `timing_s/step` up to it (training only: start-up and validation excluded).
Writes <out>/results.json and <out>/distill_vs_grpo.png; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["checkpoint.every=0", "logging.wandb.mode=disabled", "logging.sample_every=0"]
# job: (GRPO config, distillation config, overrides of both, distillation's own, held-out accuracy key)
JOBS = {
    "tiny": ("grpo_cpu_tiny.yaml", "opd_cpu_tiny.yaml", ["data.val_fraction=0.4"], [], "val/arithmetic/accuracy"),
    "smollm2": (
        "grpo_cpu_smollm2_rg.yaml",
        "grpo_cpu_smollm2_rg.yaml",
        [],
        ["algorithm.kl_coef=0", "algorithm.distill.coef=1.0", "roles.teacher.micro_batch_size=32"],
        "val/reasoning_gym/accuracy",
    ),
}
ACC = "val/arithmetic/accuracy"


def train(config: str, run_dir: Path, overrides: list[str]) -> list[dict]:
    """One run through the launcher (output in run_dir/train.log); its metrics rows."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["bash", str(ROOT / "launch" / "train.sh"), str(ROOT / "examples" / config), f"trainer.run_dir={run_dir}"]
    with open(run_dir / "train.log", "w") as log:
        t0 = time.perf_counter()
        rc = subprocess.run(cmd + COMMON + overrides, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
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
    return {"val": val, "reward": reward, "wall_s": rows[-1]["wall_s"], "train_s": t}


def reached(c: dict, target: float):
    return next(((s, sec) for s, sec, acc in c["val"] if acc >= target - 1e-9), (None, None))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=sorted(JOBS), default="tiny")
    ap.add_argument("--seeds", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--teacher-steps", type=int, default=200)
    ap.add_argument("--val-every", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "runs" / "distill_vs_grpo"))
    args = ap.parse_args()
    global ACC
    grpo_cfg, opd_cfg, both, opd_only, ACC = JOBS[args.job]
    out = Path(args.out if args.out != ap.get_default("out") else f"{args.out}_{args.job}")
    val = [f"trainer.val_every={args.val_every}", *both]
    teacher_dir = out / "teacher"
    t_rows = train(grpo_cfg, teacher_dir, [f"trainer.steps={args.teacher_steps}", "trainer.seed=1", *val])
    teacher = curve(t_rows)
    t_acc = teacher["val"][-1][2]
    target = t_acc - 0.03
    runs = {}
    for seed in args.seeds:  # the two methods one after the other per seed: drift hits both alike
        common = [f"trainer.steps={args.steps}", f"trainer.seed={seed}", *val]
        opd = [f"model.teacher_path={teacher_dir / 'final_model'}", *opd_only, *common]
        runs[f"distill/{seed}"] = curve(train(opd_cfg, out / f"distill_{seed}", opd))
        same = seed == 1 and args.steps == args.teacher_steps  # GRPO seed 1 is the teacher's own run
        runs[f"grpo/{seed}"] = teacher if same else curve(train(grpo_cfg, out / f"grpo_{seed}", common))
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
