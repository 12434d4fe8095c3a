"""`PPOTrainer`: the Python front door to the same loop the CLI runs (one code path: a RunConfig)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

from verl_ds.config import (
    AlgorithmConfig,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    RolesConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
    from_dict,
    load_config,
    validate,
)
from verl_ds.precision import PrecisionConfig


class PPOTrainer:
    """Build from section objects (or plain dicts), a RunConfig, or a YAML path plus dotted overrides:

        PPOTrainer(model_config=ModelConfig(path=...), data_config=DataConfig(...),
                   precision_config=PrecisionConfig(actor_dtype="fp16", ...), reward_fn=my_fn).fit()

    A section given here replaces that section of `config` (whose other sections stay). `reward_fn`
    `(response_text, answer) -> float` replaces `data.reward_fn`. `.fit()` trains and returns the
    final metrics.
    """

    def __init__(
        self,
        config: Union[RunConfig, str, None] = None,
        *,
        overrides: Optional[list[str]] = None,
        model_config: Union[ModelConfig, dict, None] = None,
        data_config: Union[DataConfig, dict, None] = None,
        algorithm_config: Union[AlgorithmConfig, dict, None] = None,
        rollout_config: Union[RolloutConfig, dict, None] = None,
        roles_config: Union[RolesConfig, dict, None] = None,
        precision_config: Union[PrecisionConfig, dict, None] = None,
        logging_config: Union[LoggingConfig, dict, None] = None,
        checkpoint_config: Union[CheckpointConfig, dict, None] = None,
        trainer_config: Union[TrainerConfig, dict, None] = None,
        reward_fn: Optional[Callable[[str, str], float]] = None,
    ):
        cfg = dataclasses.replace(config) if isinstance(config, RunConfig) else load_config(config, overrides)
        sections = dict(
            model=model_config,
            data=data_config,
            algorithm=algorithm_config,
            rollout=rollout_config,
            roles=roles_config,
            precision=precision_config,
            logging=logging_config,
            checkpoint=checkpoint_config,
            trainer=trainer_config,
        )
        for name, value in sections.items():
            if value is not None:
                cls = type(getattr(cfg, name))
                setattr(cfg, name, from_dict(cls, value, f"{name}.") if isinstance(value, dict) else value)
        validate(cfg)
        self.config, self.reward_fn = cfg, reward_fn

    def render_ds_configs(self, world_size: Optional[int] = None) -> dict:
        from verl_ds.ds_config import render_ds_configs

        return render_ds_configs(self.config, world_size)

    def fit(self) -> dict[str, float]:
        from verl_ds.trainer import train

        return train(self.config, reward_fn=self.reward_fn)
