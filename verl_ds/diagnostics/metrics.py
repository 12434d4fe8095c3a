"""Metric sinks: `metrics.jsonl` (always), W&B (online/offline/disabled), and cross-rank reduction.

Only rank 0 writes. Values are reduced across ranks first (see `reduce_metrics`).
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

SUMMED = {"perf/throughput", "env/failures"}  # per-rank tokens/s and failed episodes add up to the job's


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Mean over the ranks that report a key (max for `*_max`, `*/max` and `memory/*`, sum for SUMMED).
    Ranks may differ in keys: e.g. a multi-turn metric only a rank whose episodes used a tool reports."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return dict(metrics)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: float(v) for k, v in metrics.items()})
    out = {}
    for key in sorted({k for m in everyone for k in m}):
        vals = [m[key] for m in everyone if key in m]
        if key in SUMMED:
            out[key] = sum(vals)
        elif key.endswith(("_max", "/max")) or key.startswith("memory/"):  # the worst rank is what matters
            out[key] = max(vals)
        else:
            out[key] = sum(vals) / len(vals)
    return out


class Timer:
    """`with timer("gen"): ...` accumulates seconds into `timing_s/gen`."""

    def __init__(self, on_phase=None):
        """`on_phase(name, stage)`: called as each phase begins (where the run is, `diagnostics.progress`)."""
        self.times: dict[str, float] = {}
        self.on_phase = on_phase

    @contextmanager
    def __call__(self, name: str, stage: str | None = None, role: str | None = None):
        """Time phase `name` (`stage`/`role` are for MemoryTimer, which also accounts memory)."""
        if self.on_phase is not None:
            self.on_phase(name, stage)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_initialized():  # CUDA kernels run asynchronously: charge them to this phase
                torch.cuda.synchronize()
            key = f"timing_s/{name}"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - t0

    def memory_metrics(self) -> dict[str, float]:
        return {}


class MetricsLogger:
    """Writes one JSON line per step and mirrors it to W&B. Secrets never reach the config. `last_step`: the
    run's rows of an earlier run in this dir that stay, those up to that step (-1: none; a fresh run starts a
    new file, and a resumed run drops the rows the interrupted run wrote after its checkpoint)."""

    def __init__(self, run_dir: str | Path, wandb_cfg, config: dict, last_step: int, enabled: bool = True):
        self.enabled = enabled
        self.run = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        _keep_until(self.path, last_step)
        self._fh = self.path.open("a")
        if wandb_cfg.mode != "disabled":
            import wandb

            self.run = wandb.init(
                mode=wandb_cfg.mode,
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                name=wandb_cfg.run_name,
                dir=str(run_dir),
                config=config,
                reinit="finish_previous",
            )

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
        self._fh.write(json.dumps({"step": step, **clean}) + "\n")
        self._fh.flush()
        if self.run is not None:
            self.run.log({k: float(v) for k, v in metrics.items()}, step=step)

    def log_samples(self, rows: list[tuple[str, str, float]], step: int, key: str = "samples") -> None:
        """A W&B table of (prompt, response, reward) generations."""
        if self.enabled and self.run is not None:
            import wandb

            self.run.log({key: wandb.Table(columns=["prompt", "response", "reward"], data=rows)}, step=step)

    def finish(self) -> None:
        if not self.enabled:
            return
        self._fh.close()
        if self.run is not None:
            self.run.finish()
            self.run = None


def _keep_until(path: Path, last_step: int) -> None:
    """`path`'s rows up to `last_step` (-1: none), rewritten atomically."""
    if not path.exists():
        return
    rows = [
        line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= last_step
    ]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{line}\n" for line in rows))
    os.replace(tmp, path)
