"""verl-ds: RL post-training for LLMs on DeepSpeed, with per-role precision."""

__version__ = "0.1.0"

_LAZY = {
    "PPOTrainer": "verl_ds.train.api",
    "Trainer": "verl_ds.train.sft",
    "PrecisionConfig": "verl_ds.precision",
    "RunConfig": "verl_ds.config",
    "load_config": "verl_ds.config",
}


def __getattr__(name):  # heavy imports (torch, deepspeed) only when these names are used
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verl_ds' has no attribute {name!r}")
