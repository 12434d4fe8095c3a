"""Running agents: `async def agent(client: openai.AsyncOpenAI, example: dict) -> float`, `n` per
example, each with its own client against an `AgentServer`; their calls' rows and rewards become the
`Rollout` the trainer takes (`AgentEpisodes.collect` has `episodes.collect`'s shape, so the trainer's
step is the same for both). An agent that raises or times out ends only its episode (reward 0,
counted); one that breaks the contract (not a coroutine function, a reward that is not a number)
stops the run in one line.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import ssl
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable

from verl_ds import dist as vdist
from verl_ds.errors import ConfigError, RunFailure, callable_name, real_number, shown

from ..engines.distributed import GroupLeader, follow, prompt_positions
from ..engines.engine import RolloutEngine
from ..episodes import Episode, Rollout, Sampling, SeedKey, assemble
from .protocol import EPISODE_HEADER
from .recorder import Track
from .server import AgentServer

log = logging.getLogger(__name__)

FIRST_STEP = SeedKey(run_seed=0, step=0)


async def run_agent(agent_fn, server: AgentServer, episode: str, example: dict, timeout_s: float, tls):
    """One agent with its own client; (reward, failure message)."""
    import httpx
    import openai

    http = httpx.AsyncClient(trust_env=False, timeout=timeout_s, verify=tls)  # loopback: never through a proxy
    client = openai.AsyncOpenAI(
        base_url=server.base_url,
        api_key=server.api_key,
        default_headers={EPISODE_HEADER: episode},
        max_retries=0,
        http_client=http,
    )
    try:
        reward = await asyncio.wait_for(agent_fn(client, example), timeout=timeout_s)
    except asyncio.TimeoutError:
        return 0.0, f"timed out after {timeout_s}s"
    except Exception as e:  # the agent's own mistake ends only its episode, counted (one line a step)
        log.debug("agent failure (reward 0, counted in agent/failures)", exc_info=e)
        return 0.0, f"{type(e).__name__}: {e}"
    finally:
        await client.close()
        await http.aclose()
    number = real_number(reward)
    if number is None:  # the contract itself, broken the same way in every episode: the run stops
        raise ConfigError(
            "rollout.multi_turn.agent",
            f"{callable_name(agent_fn)} returned {reward!r} ({type(reward).__name__}): an agent returns its episode's "
            "reward, a finite number",
        )
    return number, ""


async def _play(
    agent_fn,
    examples: list[dict],
    server: AgentServer,
    sampling: Sampling,
    seed: SeedKey,
    timeout_s: float,
    positions: list[int] | range | None,
) -> Played:
    """Run the agents (`arun_agents`); their episodes, before they become rows."""
    check_agent(agent_fn)
    n = sampling.n
    positions = list(positions if positions is not None else range(len(examples)))
    ids = [f"{seed.step}-{seed.round_}-{p}-{j}" for p in positions for j in range(n)]
    server.begin(sampling, seed, {e: (positions[k // n], k % n) for k, e in enumerate(ids)})
    # one SSL context for the round (an HTTP client builds one by default, and on a tiny model those
    # were most of a round); a connection pool per episode (one shared pool's bookkeeping grows with
    # its connections per request)
    tls = ssl.create_default_context()
    results = await asyncio.gather(
        *[run_agent(agent_fn, server, ids[k], examples[k // n], timeout_s, tls) for k in range(len(ids))]
    )
    await asyncio.to_thread(server.scheduler.settle)  # calls of agents cancelled at their timeout may still be queued
    return played_episodes(server, ids, results, n)


async def arun_agents(
    agent_fn,
    examples: list[dict],
    server: AgentServer,
    sampling: Sampling,
    seed: SeedKey = FIRST_STEP,
    timeout_s: float = 300.0,
    positions: list[int] | range | None = None,
) -> Rollout:
    """`sampling.n` episodes of `agent_fn` per example on a started `server`, concurrently: the rows
    their calls built, each episode's reward (an agent that raises or times out: 0, counted in
    `agent/failures`) as `env_rewards`, group = the example's index. `positions`: the examples'
    global positions in the step, what seeds derive from (default: their indices)."""
    played = await _play(agent_fn, examples, server, sampling, seed, timeout_s, positions)
    return played_rollout(played, server.codec, server.engine.pad_id)


def check_agent(agent_fn, where: str = "agent") -> None:
    """An agent is `async def agent(client, example) -> float`: anything else is one line now, not a
    failure counted in every episode."""
    name = getattr(agent_fn, "__name__", None) or shown(agent_fn)
    if not inspect.iscoroutinefunction(agent_fn):
        raise ConfigError(where, f"{name} is not an `async def agent(client, example)` function")
    try:
        inspect.signature(agent_fn).bind(None, None)
    except TypeError:
        raise ConfigError(where, f"{name} must take (client, example)") from None


def run_agents(
    agent_fn,
    examples: list[dict],
    engine: RolloutEngine,
    codec,
    sampling: Sampling,
    max_model_len: int = 256,
    seed: SeedKey = FIRST_STEP,
    timeout_s: float = 300.0,
    batch_window_s: float = 0.02,
    tool_parser: Callable[[str], list] | None = None,
) -> Rollout:
    """Start an endpoint over `engine`, run `async def agent_fn(client: openai.AsyncOpenAI, example:
    dict) -> float` `sampling.n` times per example concurrently, stop the endpoint, return the `Rollout`.
    Synchronous: call it outside a running event loop (inside one, use `arun_agents`)."""
    check_agent(agent_fn)
    with AgentServer(engine, codec, sampling, max_model_len, batch_window_s, tool_parser=tool_parser) as server:
        return asyncio.run(arun_agents(agent_fn, examples, server, sampling, seed, timeout_s))


@dataclass
class AgentEpisodes:
    """A run's agent episodes (`rollout.multi_turn.agent`): one endpoint per rank for the whole run,
    over this rank's engine; `collect` has `episodes.collect`'s shape, so the trainer's step is the
    same for both. The agent receives each example without its `prompt_ids` (it writes its own
    messages; the server renders them). `tool_parser`: how a reply's text becomes tool calls."""

    agent_fn: Callable
    engine: RolloutEngine
    codec: Any
    max_model_len: int
    timeout_s: float = 300.0
    tool_parser: Callable[[str], list] | None = None
    server: AgentServer | None = None
    max_failure_fraction: float = 1.0  # `rollout.multi_turn.max_agent_failure_fraction`

    def collect(self, examples: list[dict], sampling: Sampling, seed: SeedKey) -> Rollout:
        """This rank's examples' episodes. Under tensor parallelism the group's first rank runs the
        agents of the whole group on its endpoint while the others follow its engine calls, then
        hands each member its own examples' episodes. Collective within a tensor-parallel group."""
        plain = [{k: v for k, v in ex.items() if k != "prompt_ids"} for ex in examples]
        positions = list(prompt_positions(len(examples), seed.round_))  # seeds apart across ranks and rounds
        if self.engine.tp == 1:
            played = self._round(plain, positions, sampling, seed, self.engine)
        else:
            played = self._play_as_group(plain, positions, sampling, seed)
        return played_rollout(played, self.codec, self.engine.pad_id, self.max_failure_fraction)

    def _round(self, examples, positions, sampling, seed, engine) -> Played:
        if self.server is None:
            self.server = AgentServer(
                engine, self.codec, sampling, self.max_model_len, tool_parser=self.tool_parser
            ).start()
        return asyncio.run(_play(self.agent_fn, examples, self.server, sampling, seed, self.timeout_s, positions))

    def _play_as_group(self, examples, positions, sampling, seed) -> Played:
        import torch.distributed as dist

        group, members = vdist.tp_group(self.engine.tp)
        parts: list = [None] * len(members)
        dist.all_gather_object(parts, (examples, positions), group=group)
        mine: list = [None]
        if vdist.rank() != members[0]:
            follow(self.engine)
            dist.scatter_object_list(mine, None, src=members[0], group=group)
            if mine[0] is None:
                raise RuntimeError(f"rank {members[0]} failed running its tensor-parallel group's agents")
            return mine[0]
        leader, out = GroupLeader(self.engine), [None] * len(members)
        try:
            played = self._round(
                [x for ex, _ in parts for x in ex], [p for _, pos in parts for p in pos], sampling, seed, leader
            )
            out = played.split([len(ex) for ex, _ in parts])
        finally:  # the members stop following and get their part (None: this rank failed)
            leader.release()
            dist.scatter_object_list(mine, out, src=members[0], group=group)
        return mine[0]

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@dataclass
class Played:
    """A round of agent episodes, before they become rows: per episode its rows' strict checks."""

    episodes: list[Episode]
    exact: list[list[bool]]  # per episode, per row: equal to the one-shot rendering (`_one_shot`)
    engine_calls: list[int]  # requests per engine call

    def split(self, sizes: list[int]) -> list[Played]:
        """Per consecutive run of `sizes` examples, its episodes (groups renumbered from 0)."""
        out, start = [], 0
        for size in sizes:
            keep = [k for k, ep in enumerate(self.episodes) if start <= ep.group < start + size]
            eps = [replace(self.episodes[k], group=self.episodes[k].group - start) for k in keep]
            out.append(Played(eps, [self.exact[k] for k in keep], self.engine_calls))
            start += size
        return out


def played_episodes(server: AgentServer, ids: list[str], results: list[tuple[float, str]], n: int) -> Played:
    calls_per_engine_call = list(server.engine_calls)
    tracks = server.take(ids)
    episodes = []
    for k, (eid, (reward, failure)) in enumerate(zip(ids, results)):
        t = tracks.get(eid) or Track(position=k // n, sample=k % n)
        episodes.append(
            Episode(
                group=k // n,
                sample=k % n,
                env=None,
                segments=t.segments,
                reward=reward,
                turns=t.calls,
                finish=t.finish,
                last_action=list(t.last_action),
                live=False,
                failure=failure,
                versions=list(t.versions),
            )
        )
    exact = [
        [server.recorder.one_shot(t.segment_tools[k], seg, t.segment_finish[k]) for k, seg in enumerate(t.segments)]
        for t in (tracks.get(eid) or Track(0, 0) for eid in ids)
    ]
    return Played(episodes, exact, calls_per_engine_call)


def check_agent_failures(episodes: list[Episode], max_fraction: float) -> None:
    """One console line a step for the agents that raised or timed out (their tracebacks at DEBUG), and
    a stop in one line when more than `max_fraction` of the step's episodes ended so (a broken agent,
    not an unlucky episode: `rollout.multi_turn.max_agent_failure_fraction`)."""
    failed = [ep.failure for ep in episodes if ep.failure]
    if not failed:
        return
    kinds = Counter(f.split(":")[0] for f in failed)
    if len(failed) > max_fraction * len(episodes):
        raise RunFailure(
            f"{len(failed)} of {len(episodes)} agent episodes raised or timed out (> rollout.multi_turn."
            f"max_agent_failure_fraction {max_fraction}); the first: {failed[0]}"
        )
    log.warning(
        "agent failures (reward 0, counted in agent/failures): %s; the first: %s",
        ", ".join(f"{n} x {k}" for k, n in kinds.items()),
        failed[0],
    )


def played_rollout(played: Played, codec, pad_id: int, max_failure_fraction: float = 1.0) -> Rollout:
    episodes, calls_per_engine_call = played.episodes, played.engine_calls
    check_agent_failures(episodes, max_failure_fraction)
    ro = assemble(episodes, codec, pad_id, strict=False)
    checked = [x for row in played.exact for x in row]
    ro.metrics["multi_turn/token_mismatch_fraction"] = checked.count(False) / max(len(checked), 1)
    failures = ro.metrics.pop("env/failures")
    for key in ("tools/call_frequency", "tools/failure_frequency"):  # the agent's tools are not seen here
        ro.metrics.pop(key)
    ro.metrics.update(
        {
            "agent/failures": failures,
            "agent/calls/mean": sum(ep.turns for ep in episodes) / max(len(episodes), 1),
            "agent/episodes_without_calls": float(sum(not ep.segments for ep in episodes)),
            "agent/requests_per_engine_call/mean": sum(calls_per_engine_call) / max(len(calls_per_engine_call), 1),
        }
    )
    return ro
