"""Agents as they are, behind an OpenAI-compatible endpoint, in rooms by concern (each imports only
the ones below it):

- `runner`: running agents (`run_agents`, `AgentEpisodes`) and turning their episodes into a `Rollout`
- `server`: `AgentServer`, the endpoint's lifecycle, composing the three below
- `endpoint`: the HTTP surface (FastAPI routes, the key, OpenAI's response shapes)
- `scheduler`: engine calls for the queued calls (batching windows; rounds and streams for partial rollouts)
- `recorder`: calls -> token-exact rows (continuation, forks, the strict one-shot check)
- `protocol`: OpenAI's request shapes, read and checked
"""

from .protocol import EPISODE_HEADER
from .runner import (
    AgentEpisodes,
    Played,
    arun_agents,
    check_agent,
    check_agent_failures,
    played_episodes,
    played_rollout,
    run_agent,
    run_agents,
)
from .server import AgentServer

__all__ = [
    "EPISODE_HEADER",
    "AgentEpisodes",
    "AgentServer",
    "Played",
    "arun_agents",
    "check_agent",
    "check_agent_failures",
    "played_episodes",
    "played_rollout",
    "run_agent",
    "run_agents",
]
