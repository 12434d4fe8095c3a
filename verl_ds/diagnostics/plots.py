"""Curves from a run's metrics.jsonl (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def save_panels(
    panels: list[tuple[str, list[tuple[str, list, list, dict]]]], out_png: str | Path, xlabels: list[str] | None = None
) -> Path:
    """One subplot per (title, lines); each line is (label, xs, ys, matplotlib kwargs). x axes: "step"
    unless `xlabels` names them."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend, a lighter import

    fig = Figure(figsize=(5 * len(panels), 3.5))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for i, (ax, (title, lines)) in enumerate(zip(axes[0], panels)):
        for label, xs, ys, kw in lines:
            ax.plot(xs, ys, label=label, **kw)
        ax.set_xlabel(xlabels[i] if xlabels else "step")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    return Path(out_png)


def plot_curves(metrics_path: str | Path, out_png: str | Path, keys=("reward/mean",), window: int = 10) -> Path:
    """Plot each key against the step, raw and as a trailing moving average (sparse keys: points)."""
    rows = read_metrics(metrics_path)
    panels = []
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if not pts:
            continue
        steps, vals = zip(*pts)
        smooth = [
            sum(vals[max(0, i - window + 1) : i + 1]) / len(vals[max(0, i - window + 1) : i + 1])
            for i in range(len(vals))
        ]
        if len(vals) < 2 * window:  # sparse (e.g. validation every k steps): the points themselves
            panels.append((key, [(key, steps, vals, {"marker": "o"})]))
            continue
        panels.append((key, [(key, steps, vals, {"alpha": 0.3}), (f"{key} (avg {window})", steps, smooth, {})]))
    return save_panels(panels or [("no data", [])], out_png)
