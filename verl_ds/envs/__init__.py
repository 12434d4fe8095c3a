"""Environments for multi-turn rollouts: the contract, the loader, and the built-in tool environment.

An environment is any class with

    reset(example: dict) -> observation | None
    step(action_text: str) -> (observation | None, reward: float, done: bool, info: dict)

one instance per episode, built with `rollout.multi_turn.env_kwargs` as keyword arguments. An
observation is a string (sent as one `user` message, or `tool` for the tool environment) or a
list of chat messages. Environments see text only: the rollout owns the token ids.
See docs/ENVIRONMENTS.md.
"""

from .base import BUILTIN_ENVS, EnvFactory, Environment, import_object, load_env_factory
from .tools import ToolEnv, calculator, load_tools, parse_hermes_tool_calls, tool_schemas

__all__ = [
    "Environment",
    "EnvFactory",
    "BUILTIN_ENVS",
    "import_object",
    "load_env_factory",
    "ToolEnv",
    "calculator",
    "load_tools",
    "parse_hermes_tool_calls",
    "tool_schemas",
]
