"""The real-model demo over seeds and precisions, measured in one run: does it learn, and why (not)?

    source launch/env.sh && python benchmarks/demo_seeds.py                       # 3 seeds, fp32
    python benchmarks/demo_seeds.py --seeds 1 2 3 --dtypes fp32 bf16              # an avx512_bf16 CPU or a GPU
    python benchmarks/demo_seeds.py --seeds 1 --dtypes fp32 -- roles.actor.lr=3e-5   # one override for all

Each (dtype, seed) runs `bash launch/demo.sh` itself (the shipped `examples/grpo_cpu_smollm2_rg.yaml`,
its launcher layout and validation) with the actor, the reference and the rollout in that dtype, into
<out>/<dtype>_s<seed>/; its wall time is the whole command's (model conversion and install excluded
once done). A run directory that already holds a finished run is read, not rerun (`--rerun` to force).
Per run: held-out greedy accuracy at every validation, the change, whether it meets the demo's claim
(+0.15 at the last validation), and the run's own metrics that explain it: policy entropy (first and
last 5 steps), KL to the reference (last 5), the rollout-vs-trainer gap (mean |Δlogprob|) and the
phantom-clip fraction (tokens PPO would clip on the same weights). Prints a Markdown table and, per
dtype, how many seeds met the claim; writes <out>/results.json. A dtype this CPU emulates (bf16 or
fp16 without avx512_bf16/AMX) is marked so: its trainer GEMMs run as fp32 products
(`precision.cpu_gemm`), vLLM's on its own CPU kernels.
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
sys.path.insert(0, str(ROOT))
from verl_ds.precision import detect_hardware  # noqa: E402

CLAIM = 0.15  # the demo's claim: held-out greedy accuracy up by this much at the last validation
ACC = "val/reasoning_gym/accuracy"


def run_demo(run_dir: Path, dtype: str, seed: int, extra: list[str]) -> float:
    """`launch/demo.sh` for one (dtype, seed) -> its wall seconds (also kept in run_dir/wall_s)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = [f"precision.{k}={dtype}" for k in ("actor_dtype", "reference_dtype", "rollout_dtype")]
    overrides += [f"trainer.seed={seed}", "logging.wandb.mode=disabled", *extra]
    env = {**os.environ, "RUN_DIR": str(run_dir)}
    with open(run_dir / "demo.log", "w") as log:
        t0 = time.perf_counter()
        rc = subprocess.run(
            ["bash", str(ROOT / "launch" / "demo.sh"), *overrides],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
        ).returncode
        wall = time.perf_counter() - t0
    if rc != 0:
        sys.exit(f"demo {dtype} seed {seed} failed (exit {rc}): see {run_dir / 'demo.log'}")
    (run_dir / "wall_s").write_text(f"{wall:.1f}\n")
    return wall


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows: list[dict], steps: int) -> dict:
    """One run's result from its metrics rows (pure)."""
    val = [(r["step"], r[ACC]) for r in rows if ACC in r]
    train = [r for r in rows if "actor/entropy" in r]

    def series(key):
        return [r.get(key, float("nan")) for r in train]

    ent = series("actor/entropy")
    return {
        "finished": bool(val) and val[-1][0] == steps,
        "val": val,
        "change": val[-1][1] - val[0][1] if val else float("nan"),
        "peak": max(v for _, v in val) if val else float("nan"),
        "entropy_first5": _mean(ent[:5]),
        "entropy_last5": _mean(ent[-5:]),
        "kl_ref_last5": _mean(series("actor/kl_ref")[-5:]),
        "reward_first5": _mean(series("reward/mean")[:5]),
        "reward_last5": _mean(series("reward/mean")[-5:]),
        "mismatch_mean": _mean(series("rollout_corr/logprob_abs_diff_mean")),
        "phantom_clip_mean": _mean(series("rollout_corr/phantom_clip_fraction")),
    }


def load(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []


def markdown(results: list[dict]) -> str:
    steps = sorted({s for r in results for s, _ in r["val"]})
    head = ["dtype", "seed", *(f"step {s}" for s in steps), "change", f">= +{CLAIM}", "peak", "entropy first5 -> last5"]
    head += ["KL ref last5", "train reward first5 -> last5", "mean abs Δlogprob", "phantom clip", "wall (min)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        acc = dict(r["val"])
        cells = [r["dtype"] + (" (emulated)" if r["emulated"] else ""), str(r["seed"])]
        cells += [f"{acc[s]:.3f}" if s in acc else "-" for s in steps]
        cells += [f"{r['change']:+.3f}", "yes" if r["change"] >= CLAIM - 1e-9 else "no", f"{r['peak']:.3f}"]
        cells += [f"{r['entropy_first5']:.2f} -> {r['entropy_last5']:.2f}", f"{r['kl_ref_last5']:.3f}"]
        cells += [f"{r['reward_first5']:.2f} -> {r['reward_last5']:.2f}", f"{r['mismatch_mean']:.1e}"]
        cells += [f"{r['phantom_clip_mean']:.2%}", f"{r['wall_s'] / 60:.1f}" if r["wall_s"] else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--dtypes", nargs="+", default=["fp32"], choices=["fp32", "bf16", "fp16"])
    p.add_argument("--steps", type=int, default=30, help="the demo's trainer.steps (checked against the runs)")
    p.add_argument("--out", default=str(ROOT / "runs" / "demo_seeds"))
    p.add_argument("--rerun", action="store_true", help="run again even where a finished run is on disk")
    p.add_argument("overrides", nargs="*", help="after --: dotted overrides for every run")
    args = p.parse_args(argv)
    extra = [*args.overrides, f"trainer.steps={args.steps}"]
    hw, out, results = detect_hardware(), Path(args.out), []
    machine = hw.device if hw.device == "cuda" else f"cpu, {'bf16 native' if hw.cpu_bf16 else 'no avx512_bf16/AMX'}"
    for dtype in args.dtypes:
        for seed in args.seeds:
            run_dir = out / f"{dtype}_s{seed}"
            res = summarize(load(run_dir), args.steps)
            if args.rerun or not res["finished"]:
                run_demo(run_dir, dtype, seed, extra)
                res = summarize(load(run_dir), args.steps)
            wall = run_dir / "wall_s"
            res.update(
                dtype=dtype,
                seed=seed,
                emulated=hw.emulates(dtype),
                wall_s=float(wall.read_text()) if wall.exists() else None,
            )
            results.append(res)
    print(markdown(results))
    for dtype in args.dtypes:
        mine = [r for r in results if r["dtype"] == dtype]
        met = sum(r["change"] >= CLAIM - 1e-9 for r in mine)
        print(f"{dtype}: {met} of {len(mine)} seeds at >= +{CLAIM} held-out accuracy ({machine})")
    (out / "results.json").write_text(json.dumps({"machine": machine, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
