"""`verl-ds debug memory`'s measured side: one real step of the configured job. The estimate, the
tables and the plan search are `diagnostics.memory` (no trainer needed)."""

from __future__ import annotations

from verl_ds.config import RunConfig
from verl_ds.diagnostics import memory
from verl_ds.trainer.rl_trainer import RLTrainer


def measure_step(cfg: RunConfig) -> tuple[dict[str, dict[str, dict[str, float]]], int]:
    """Build the real roles, run one step with activations tracked; return each stage's measured
    memory per role (`memory.stages_from_metrics`) and the world size it ran in."""
    with RLTrainer(cfg) as trainer:
        trainer.track_activations = True
        measured = memory.stages_from_metrics(trainer.step())
    return measured, trainer.world
