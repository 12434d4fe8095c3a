"""Episodes: the one rollout path (`loop`), the environment contract it crosses (`environment`), and
the typed records it builds and hands the trainer (`episode`)."""

from .environment import Environment, env_reset, env_step, observation_role
from .episode import Episode, EpisodeSpec, Rollout, Sampling, SeedKey, Segment, TurnLimits
from .loop import (
    advance,
    asked_for,
    assemble,
    check_failures,
    collect,
    collect_remote,
    request,
    start_episodes,
    take,
)

__all__ = [
    "Environment",
    "env_reset",
    "env_step",
    "observation_role",
    "Episode",
    "EpisodeSpec",
    "Rollout",
    "Sampling",
    "SeedKey",
    "Segment",
    "TurnLimits",
    "advance",
    "asked_for",
    "collect_remote",
    "assemble",
    "check_failures",
    "collect",
    "request",
    "start_episodes",
    "take",
]
