"""Curves from a run's metrics.jsonl (matplotlib, headless)."""
from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(metrics_path: str | Path, out_png: str | Path, keys=("reward/mean",), window: int = 10) -> Path:
    """Plot each key against the step, raw and as a trailing moving average."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if not pts:
            continue
        steps, vals = zip(*pts)
        smooth = [sum(vals[max(0, i - window + 1):i + 1]) / len(vals[max(0, i - window + 1):i + 1])
                  for i in range(len(vals))]
        ax.plot(steps, vals, alpha=0.3, label=key)
        ax.plot(steps, smooth, label=f"{key} (avg {window})")
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
