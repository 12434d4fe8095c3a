"""Learning with partial rollouts against the synchronous step, side by side: held-out accuracy at the
same number of trained samples (every step trains `prompts_per_step` whole groups in both cells).

    source launch/env.sh && python benchmarks/partial_curves.py [--seeds 1 2] [--steps 30]

The job is `benchmarks/partial_rollouts.py`'s (the real-model demo's task with room to answer,
`--new-tokens` 192), validated every `--val-every` steps on the demo's held-out problems (greedy
accuracy, `val/reasoning_gym/accuracy`; and the mean over 2 samples). Cells run one after another,
seed by seed, and each cell's rows are written as it ends (<out>/curves.json), so a cut run keeps
what it finished. Timings here are not a comparison (see partial_rollouts.py for that).
"""

from __future__ import annotations

import argparse
import json

from demo_job import ROOT, require_model, train_demo
from partial_rollouts import long_tail

ACC, MEAN = "val/reasoning_gym/accuracy", "val/reasoning_gym/mean@2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--val-every", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--staleness", type=int, default=4, help="rollout.partial.max_staleness")
    ap.add_argument("--over", type=float, default=3.0, help="rollout.partial.over_provision")
    ap.add_argument("--out", default="runs/partial_curves")
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        help="more overrides for both cells (key=value), e.g. a larger held-out set: data.reasoning_gym.val_size=1000",
    )
    args = ap.parse_args()
    require_model()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    cells = {
        "synchronous": [],
        "partial": [
            "rollout.partial.enabled=true",
            f"rollout.partial.max_staleness={args.staleness}",
            f"rollout.partial.over_provision={args.over}",
        ],
    }
    curves: list[dict] = []
    for seed in args.seeds:
        for name, overrides in cells.items():
            val = [f"trainer.val_every={args.val_every}", "trainer.val_n=2"]
            job = [*long_tail(args.new_tokens), *overrides, *val, *args.set]
            rows = train_demo(out / f"s{seed}_{name}", job, args.steps, seed)
            curve = {
                "seed": seed,
                "cell": name,
                "val": {r["step"]: [r[ACC], r[MEAN]] for r in rows if ACC in r},
                "reward": [r["reward/mean"] for r in rows],
                "response_tokens": [r["response_length/mean"] for r in rows],
                "staleness": [r.get("partial/staleness/mean", 0.0) for r in rows],
            }
            curves.append(curve)
            (out / "curves.json").write_text(json.dumps(curves, indent=1))
            print(json.dumps({k: curve[k] for k in ("seed", "cell", "val")}), flush=True)
    print("\n| seed | step | synchronous accuracy / mean@2 | partial accuracy / mean@2 | partial - synchronous |")
    print("|---|---|---|---|---|")
    for seed in args.seeds:
        sync, part = (next((c for c in curves if c["seed"] == seed and c["cell"] == n), None) for n in cells)
        for step in sorted(sync["val"] if sync else []):
            s, p = sync["val"][step], (part or {}).get("val", {}).get(step)
            gap = f"{p[0] - s[0]:+.3f}" if p else ""
            ptxt = f"{p[0]:.3f} / {p[1]:.3f}" if p else ""
            print(f"| {seed} | {step} | {s[0]:.3f} / {s[1]:.3f} | {ptxt} | {gap} |")


if __name__ == "__main__":
    main()
