"""`PPOTrainer`: the Python front door to the same loop the CLI runs (one code path: a RunConfig)."""
from __future__ import annotations

import dataclasses

from verl_ds.config import RunConfig, from_dict, load_config, validate
from verl_ds.errors import ConfigError

_SECTIONS = {f.name for f in dataclasses.fields(RunConfig)}


class PPOTrainer:
    """Build from section objects (or dicts), a RunConfig, or a YAML path plus dotted overrides:

        PPOTrainer(model_config=ModelConfig(path=...), data_config=DataConfig(...),
                   precision_config=PrecisionConfig(actor_dtype="fp16", ...), reward_fn=my_fn).fit()

    Any section may be passed as `<section>_config=` (model, data, algorithm, rollout, roles,
    precision, logging, checkpoint, trainer). `.fit()` trains and returns the final metrics.
    """

    def __init__(self, config: RunConfig | str | None = None, *, overrides: list[str] | None = None,
                 reward_fn=None, **section_configs):
        if isinstance(config, RunConfig):
            cfg = dataclasses.replace(config)
        else:
            cfg = load_config(config, overrides)
        for key, value in section_configs.items():
            name = key.removesuffix("_config")
            if not key.endswith("_config") or name not in _SECTIONS:
                raise ConfigError(key, f"unknown argument (use one of: {', '.join(s + '_config' for s in sorted(_SECTIONS))})")
            field_type = type(getattr(cfg, name))
            setattr(cfg, name, from_dict(field_type, value, f"{name}.") if isinstance(value, dict) else value)
        validate(cfg)
        self.config, self.reward_fn = cfg, reward_fn

    def render_ds_configs(self, world_size: int | None = None) -> dict:
        from verl_ds.config import render_ds_configs
        return render_ds_configs(self.config, world_size)

    def fit(self) -> dict[str, float]:
        from verl_ds.trainer import train
        return train(self.config, reward_fn=self.reward_fn)
