"""The environment contract and `load_env_factory`: `rollout.multi_turn.env` -> a per-episode factory."""

from __future__ import annotations

import importlib
import inspect
import typing
import zlib
from typing import Any, Callable, Protocol, Union

from verl_ds.errors import ConfigError, shown, where

Observation = Union[str, list, None]


class Environment(Protocol):
    """What the episode loop calls: `reset` once, then `step` after every model turn until done.
    An optional class attribute `observation_role` (default "user") is the role a string
    observation is sent as. The loop's own view of this contract is `rollout.episodes.Environment`
    (rollout and envs are independent layers: neither imports the other)."""

    def reset(self, example: dict) -> Observation: ...

    def step(self, action: str) -> tuple[Observation, float, bool, dict]: ...


EnvFactory = Callable[[], Environment]

# built-in names for rollout.multi_turn.env (a `pkg.module:Class` path loads a user's class)
BUILTIN_ENVS = {
    "tools": "verl_ds.envs.tools:ToolEnv",
    "retry": "verl_ds.envs.retry:RetryEnv",
    "textarena": "verl_ds.envs.textarena:TextArenaEnv",
    "openenv": "verl_ds.envs.openenv:OpenEnvEnv",
}


def example_seed(example: dict) -> int:
    """The seed of an episode's game or environment: the data row's `seed` key (held-out seeds for
    validation are another data file), else a hash of its prompt (the same prompt, the same game)."""
    seed = example.get("seed")
    return int(seed) if seed is not None else zlib.crc32(str(example.get("prompt", "")).encode())


def import_object(spec: str, key: str) -> Any:
    """`pkg.module:Name` (or `pkg.module.Name`) importable from PYTHONPATH; a ConfigError naming `key`."""
    mod_name, sep, attr = spec.partition(":")
    if not sep:
        mod_name, _, attr = spec.rpartition(".")
    if not mod_name or not attr:
        raise ConfigError(key, f"'{spec}' is not a 'pkg.module:Name' path")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise ConfigError(key, f"cannot import module '{mod_name}' ({e}); is it on PYTHONPATH?") from None
    except Exception as e:  # a syntax error, or the module's own code raising while it is imported
        raise ConfigError(key, f"importing '{mod_name}' failed at {where(e)}: {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        raise ConfigError(key, f"module '{mod_name}' has no '{attr}'")
    return getattr(module, attr)


def _check_method(cls, name: str, n_args: int, key: str) -> None:
    fn = getattr(cls, name, None)
    if not callable(fn):
        raise ConfigError(key, f"{cls.__name__} has no method {name}() (an environment needs reset and step)")
    try:
        inspect.signature(fn).bind(None, *([None] * n_args))
    except TypeError:
        raise ConfigError(
            key, f"{cls.__name__}.{name} must take {n_args} argument(s) besides self, got {name}{inspect.signature(fn)}"
        ) from None


def load_env_factory(
    spec: str, env_kwargs: dict, tools: list | None = None, key: str = "rollout.multi_turn.env"
) -> EnvFactory:
    """A zero-argument factory building one environment per episode. Checked now (import, methods,
    constructor arguments), so a bad path or signature is one line at start, not a crash mid-run.
    The tool environment also gets `tools` (the functions of `data.tools`)."""
    builtin, colon, rest = spec.partition(":")
    if colon and builtin in BUILTIN_ENVS:  # `textarena:GuessTheNumber-v0`, a natural guess
        where = "its settings in env_kwargs"
        if builtin == "textarena":
            where = f"its game in env_kwargs: {{env_id: {rest}}}"
        raise ConfigError(key, f"'{spec}': the built-in environment is `env: {builtin}`, {where}")
    cls = import_object(BUILTIN_ENVS.get(spec, spec), key)
    if not inspect.isclass(cls):
        raise ConfigError(key, f"'{spec}' is not a class")
    _check_method(cls, "reset", 1, key)
    _check_method(cls, "step", 1, key)
    kwargs = dict(env_kwargs)
    if "tools" in inspect.signature(cls).parameters and tools is not None:
        kwargs.setdefault("tools", tools)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ConfigError("rollout.multi_turn.env_kwargs", f"{cls.__name__}({', '.join(kwargs)}): {e}") from None
    _check_kwarg_types(cls, kwargs)
    check = getattr(cls, "check_kwargs", None)  # optional: what the class can tell of its arguments now
    if callable(check):
        check(**kwargs)
    return lambda: cls(**kwargs)


_SIMPLE = (int, float, str, bool)


def _check_kwarg_types(cls, kwargs: dict) -> None:
    """Each keyword argument against its constructor annotation where that is int, float, str or
    bool (a quoted "3" for an int, seen only when the environment compares it, is a start-up line)."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # annotations that do not resolve: nothing to check against
        return
    for name, value in kwargs.items():
        want = hints.get(name)
        if want not in _SIMPLE:
            continue
        accepted = (int, float) if want is float else want  # an int where a float goes, as YAML writes 1
        if not isinstance(value, accepted) or (want is not bool and isinstance(value, bool)):
            raise ConfigError(
                f"rollout.multi_turn.env_kwargs.{name}",
                f"{cls.__name__} takes {name}: {want.__name__}, got {shown(value)} ({type(value).__name__})",
            )
