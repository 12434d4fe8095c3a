"""What a diagnostic (or a test) may watch in the loop without replacing the trainer's methods:
`RLTrainer.observers` take these hooks (roles have their own: `roles.base.RoleObserver`). Every hook
is optional and runs on the calling rank, inside the step."""

from __future__ import annotations

from verl_ds.roles.batch import TrainBatch
from verl_ds.rollout.episodes import Rollout


class TrainerObserver:
    def on_rollout(self, trainer, rollout: Rollout, scores) -> None:
        """After a training rollout is scored (each round of dynamic sampling): its rows and raw scores."""

    def on_train_batch(self, trainer, train: TrainBatch) -> None:
        """Before the ppo_epochs over `train` (the rows with advantages, returns, stored logprobs).
        `train.on_policy`: the first epoch's forward provides the old logprobs."""
