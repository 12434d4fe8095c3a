"""The environment contract as the episode loop crosses it: what an environment is (`Environment`), and
what its `reset` and `step` may return, checked where it enters verl-ds (`env_reset`, `env_step`):
a wrong shape is one line naming the class, the method, what it returned and the contract.
envs/base.py's `Environment` is the same contract for its authors; rollout imports no envs.
"""

from __future__ import annotations

import numbers
from typing import Any, Protocol

from verl_ds.errors import ConfigError, shown

DEFAULT_OBSERVATION_ROLE = "user"


class Environment(Protocol):
    """What the loop calls on an environment: `reset` once, then `step` after every model turn until
    done (envs/base.py's `Environment` is the same contract for its authors; rollout imports no envs).
    What they return is checked where it enters verl-ds: `env_reset`, `env_step`.

    Optional class attribute `observation_role: str`: the chat role a string observation is sent
    as. An environment that does not declare it gets "user" (`observation_role(env)`); it is not a
    Protocol member, since a Protocol cannot declare an attribute that may be absent."""

    def reset(self, example: dict) -> Any: ...

    def step(self, action: str) -> Any: ...


def observation_role(env: Environment) -> str:
    """The role a string observation of `env` is sent as: its `observation_role`, else "user"."""
    return getattr(env, "observation_role", DEFAULT_OBSERVATION_ROLE)


def _contract_error(env, method: str, got: Any, wants: str) -> ConfigError:
    return ConfigError(f"{type(env).__name__}.{method}()", f"returned {shown(got)}; the contract is {wants}")


_OBS = "an observation: a string, a list of chat messages, or None"
_STEP = "(observation, reward, done, info), or gym's (observation, reward, terminated, truncated, info)"


def _observation(env, method: str, obs: Any, got: Any) -> str | list | None:
    if (
        obs is None
        or isinstance(obs, str)
        or (isinstance(obs, list) and all(isinstance(m, dict) and "content" in m for m in obs))
    ):
        return obs
    raise _contract_error(env, method, got, _OBS)


def env_reset(env, example: dict) -> str | list | None:
    """`env.reset(example)`, checked: an observation (None: the task's prompt opens the episode).
    Gym's `(observation, info)` is accepted, its info dropped."""
    got = env.reset(example)
    obs = got[0] if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict) else got
    return _observation(env, "reset", obs, got)


def env_step(env, action: str) -> tuple[str | list | None, float, bool, dict]:
    """`env.step(action)`, checked: (observation, reward, done, info). Gym's 5-tuple is accepted:
    done = terminated or truncated. A wrong shape is one line naming the class, the method, what it
    returned and the contract (a ConfigError: the environment's author has a mistake to fix)."""
    got = env.step(action)
    if isinstance(got, tuple) and len(got) == 5:
        obs, reward, terminated, truncated, info = got
        done = bool(terminated) or bool(truncated)
    elif isinstance(got, tuple) and len(got) == 4:
        obs, reward, done, info = got
    else:
        raise _contract_error(env, "step", got, _STEP)
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not isinstance(info, (dict, type(None))):
        raise _contract_error(env, "step", got, _STEP + " with a number for reward and a dict for info")
    return _observation(env, "step", obs, got), float(reward), bool(done), dict(info or {})
