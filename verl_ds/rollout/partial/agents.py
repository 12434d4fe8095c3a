"""Partial rollouts of agent episodes: a step trains the agent groups that finished first; the other
agents wait on their calls through the training step and go on, on the new weights.

The pool, its admission and its earliest-deadline pick are `PartialRollouts`'; what differs is how
episodes advance. Each admitted group's `n` agents start as tasks on an event loop of their own
(alive across steps) against an endpoint in rounds mode (`AgentServer(rounds=True)`): their calls
wait in its queue until the step runs a round. A round starts once every live agent waits on a
call or has ended, so what a round holds does not depend on timing. Where some group could pause,
a round is one engine stream (step-and-abort, as `PartialRollouts`): a call that ends is answered,
the agents act on it before the next engine step and their new calls join the running batch, and
the moment the step can pick, the calls still running are cut where they got; they go on at the
next round, after the weight sync, their tokens tagged with the version that sampled them. An
agent whose call is cut never sees it: its HTTP response comes when the call ends.

An agent's state cannot be saved: a checkpoint keeps the pool's groups, and on resume the groups
whose agents had started restart from their prompts (one log line says how many). An agent's
timeout (`agent_timeout_s`) counts the steps it waits through in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import ssl
import threading

from ..agents import AgentEpisodes, AgentServer, played_episodes, played_rollout, run_agent
from ..engines.engine import RolloutEngine
from ..episodes import Episode, Rollout, Sampling
from .pool import InFlight, PartialLimits, PartialRollouts

log = logging.getLogger(__name__)


class PartialAgents(PartialRollouts):
    """This rank's pool of agent groups (`rollout.partial` with `rollout.multi_turn.agent`): the
    agent, its codec, budget and timeout are `agents`' (the run's `AgentEpisodes`, whose own endpoint
    keeps serving validation); this pool has an endpoint of its own, in rounds mode."""

    def __init__(
        self,
        engine: RolloutEngine,
        limits: PartialLimits,
        prompts: list[dict],
        draw,
        sampling: Sampling,
        run_seed: int,
        agents: AgentEpisodes,
    ):
        super().__init__(engine, limits, prompts, draw, sampling, run_seed)
        self.agents = agents
        self.server = AgentServer(
            engine, agents.codec, sampling, agents.max_model_len, tool_parser=agents.tool_parser, rounds=True
        ).start()
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="partial-agents", daemon=True)
        self._loop_thread.start()
        self.runs: dict[str, concurrent.futures.Future] = {}  # episode id -> its agent's (reward, failure)
        self.tls = ssl.create_default_context()  # one for every client (see agents.runner._play)

    def _ids(self, g: InFlight) -> list[str]:
        return [f"{g.order}-{j}" for j in range(self.sampling.n)]

    def _started(self, g: InFlight) -> bool:
        return self._ids(g)[0] in self.runs

    def _done(self, g: InFlight) -> bool:
        ids = self._ids(g)
        return all(e in self.runs and self.runs[e].done() for e in ids) and self.server.scheduler.settled(ids)

    def _round(self, version: int) -> int:
        """Start the new groups' agents, wait until every live agent waits on a call or has ended,
        then, while some live group is not due this step, one engine stream over the calls until this
        step can pick (the agents act on each answer before the next engine step, so what the stream
        holds does not depend on timing); else one engine call over the waiting calls, and wait again,
        so that the pick sees where every agent stands. -> its decode steps."""
        s = self.limits.max_staleness
        live = [g for g in self.pool if not self._done(g)]
        pause = any(g.born + s > version for g in live)
        fresh = [g for g in live if not self._started(g)]
        self.server.add(self.run_seed, {e: (*g.key, j) for g in fresh for j, e in enumerate(self._ids(g))})
        for g in fresh:
            example = {k: v for k, v in self.prompts[g.index].items() if k != "prompt_ids"}
            for e in self._ids(g):
                run = run_agent(self.agents.agent_fn, self.server, e, example, self.agents.timeout_s, self.tls)
                self.runs[e] = asyncio.run_coroutine_threadsafe(run, self.loop)
                self.runs[e].add_done_callback(lambda _: self.server.scheduler.poke())
        self._wait_for_agents()
        if pause:  # step-and-abort: the calls run until this step can pick, then are cut where they got

            def cut(running: int, peak: int) -> bool:
                return self._cut(version, running, peak)

            return self.server.scheduler.stream_round(self.limits.chunk_tokens, version, cut, self._wait_for_agents)
        steps = self.server.scheduler.round(None, version)
        self._wait_for_agents()
        return steps

    def _wait_for_agents(self) -> None:
        """Until every live agent waits on the server or has ended (an agent busy elsewhere past its
        timeout ends: `run_agent` cancels it)."""

        def live() -> list[str]:
            return [e for e, run in list(self.runs.items()) if not run.done()]

        self.server.scheduler.wait_until_waiting(live, self.agents.timeout_s + 10.0)

    def _rows(self, taken: list[InFlight]) -> tuple[Rollout, list[Episode]]:
        ids = [e for g in taken for e in self._ids(g)]
        results = [self.runs.pop(e).result() for e in ids]
        played = played_episodes(self.server, ids, results, self.sampling.n)
        self.server.engine_calls.clear()  # the step's batching, counted from here
        return played_rollout(played, self.agents.codec, self.engine.pad_id, self.agents.max_failure_fraction), (
            played.episodes
        )

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """The pool's groups, without their agents' progress (their state cannot be saved)."""
        return {**super().state_dict(), "agents_started": [g.order for g in self.pool if self._started(g)]}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        restarted = len(state.get("agents_started", []))
        if restarted:
            log.warning(
                "resume: %d agent group(s) in flight restart from their prompts (an agent's state cannot be saved)",
                restarted,
            )

    def close(self) -> None:
        """Cancel the agents in flight, fail the calls still waiting (their requests end), stop the
        endpoint and the agents' loop."""
        for run in self.runs.values():
            run.cancel()
        self.server.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=10)
