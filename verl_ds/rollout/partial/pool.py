"""Partial rollouts: a step trains on groups that have finished and does not wait for the slowest.

Each rank keeps a pool of prompt groups in flight across steps. A step runs every live episode in
one stream of the engine (`RolloutEngine.stream`: vLLM steps its engine one token at a time, HF
generate runs chunks of `chunk_tokens`); once it can train `groups_per_step` finished groups and
what still runs is the engine's tail (`tail_fraction` of the most it ran), it stops and cuts it
(step-and-abort), and the unfinished episodes stay in the pool
with their ids, rollout logprobs and, per token, the weights version that sampled it (a
tensor-parallel group instead generates in lockstep rounds of capped engine calls). After the
weight sync they continue from their ids on the new weights (the engine recomputes their KV), so
one response may span several versions. The loss corrects for that with the truncated importance
weight on the rollout logprobs (`algorithm.tis_cap`: decoupled PPO, the proximal policy being the
weights the step starts from).

Staleness is bounded by admission, never by dropping work: a group admitted at version v is
trained at a version <= v + max_staleness. The pool holds at most (max_staleness + 1) x
groups_per_step untrained groups, and a step trains the oldest finished groups first, stopping
only when what stays in the pool can still be trained in time (earliest-deadline-first: for every
later step j, the groups due by then fit in j steps' batches). With max_staleness 0 no group
outlives its step and every round runs to the full budget, so the step is the synchronous one,
bitwise.

Episodes are `episodes`', advanced by its `advance`: single-turn, or an environment's turns,
where a pause falls inside a model turn (the turn goes on at the next round) or between turns.
Seeds: a new group's first call samples its n episodes in one request seeded as the synchronous
step seeds that prompt; every later request is one per episode, seeded from (run seed, the group's
step and position, sample, the episode's call count) (`turn_seed`), so a resumed run continues
identically. Under tensor parallelism each member keeps its own pool and the group generates in
lockstep: a round (one engine call capped at `chunk_tokens` a request) runs while any member cannot
pick yet. `state_dict` holds everything a checkpoint needs to resume the pool exactly
(environments are rebuilt by replaying the actions).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable

import torch

from verl_ds import dist as vdist

from ..batch import RolloutBatch
from ..engines.distributed import prompt_positions
from ..engines.engine import RolloutEngine
from ..episodes import (
    Episode,
    EpisodeSpec,
    Rollout,
    Sampling,
    Segment,
    advance,
    assemble,
    check_failures,
    env_reset,
    env_step,
    request,
    start_episodes,
    take,
)
from ..seeding import prompt_seed


@dataclass
class InFlight:
    """One prompt's group: its `n` episodes as far as they got (none before its first round)."""

    index: int  # the prompt's index in the data
    born: int  # the weights version (step) it was admitted at
    key: tuple[int, int]  # (step, position): what its seeds derive from
    order: int  # admission order on this rank (ties in age)
    episodes: list[Episode] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return bool(self.episodes) and not any(ep.live for ep in self.episodes)


@dataclass
class _Tally:
    """This step's partial/* counts so far (a step's collects add up: dynamic sampling)."""

    version: int = -1
    ages: list[int] = field(default_factory=list)  # per trained model token: versions behind
    spanned: list[bool] = field(default_factory=list)  # per trained episode: sampled by several versions
    rounds: int = 0  # engine calls or streams
    decode: int = 0  # their decode steps
    resent: int = 0  # context tokens of episodes going on, sent again (the KV partial rollouts recompute)


@dataclass(frozen=True)
class PartialLimits:
    groups_per_step: int  # this rank's groups trained per step
    max_staleness: int  # versions between a group's admission and its training, at most
    in_flight: int  # groups in the pool at most (over-provisioning)
    chunk_tokens: int  # new tokens per episode per round
    tail_fraction: float  # a stream is cut once the step can pick and it runs <= this x its most


class PartialRollouts:
    """This rank's pool over `prompts` (each `{"prompt_ids", ...}`). `draw()` returns the indices of
    this rank's next prompts, as the synchronous step would draw them."""

    def __init__(
        self,
        engine: RolloutEngine,
        limits: PartialLimits,
        prompts: list[dict],
        draw: Callable[[], list[int]],
        sampling: Sampling,
        run_seed: int,
        spec: EpisodeSpec | None = None,
    ):
        self.engine, self.limits, self.prompts, self.draw = engine, limits, prompts, draw
        self.sampling, self.run_seed, self.spec = sampling, run_seed, spec
        self.pool: list[InFlight] = []
        self.queue: list[tuple[int, int, int]] = []  # (prompt index, draw step, position) not yet admitted
        self.admitted = 0
        self.draws: tuple[int, int] = (-1, 0)  # (step, draws in that step): the next draw's round
        self._tally = _Tally()

    # ---------------------------------------------------------------- one step
    def collect(self, version: int) -> tuple[Rollout, list[dict]]:
        """Admit, generate rounds until `groups_per_step` groups can train, take them out of the pool.
        -> (their rows, contiguous per group, with partial/* metrics; the groups' examples)."""
        self._admit(version)
        if self._tally.version != version:  # metrics add up over the step's collects (dynamic sampling)
            self._tally = _Tally(version)
        while self._needs_round(version):
            steps = self._round(version)
            self._tally.rounds += 1
            self._tally.decode += steps
        picked = self._pick(version)
        taken = [self.pool[i] for i in picked]
        self.pool = [g for i, g in enumerate(self.pool) if i not in set(picked)]
        rollout, eps = self._rows(taken)
        rollout.metrics.update(self._metrics(eps, version))
        return rollout, [self.prompts[g.index] for g in taken]

    def _rows(self, taken: list[InFlight]) -> tuple[Rollout, list[Episode]]:
        """The taken groups' rows (the rows' group ids index `taken`), and their episodes."""
        eps = [ep for g in taken for ep in g.episodes]
        for i, g in enumerate(taken):
            for ep in g.episodes:
                ep.group = i
        if self.spec is None:  # single-turn: the engine's rows as the synchronous step builds them
            batch = RolloutBatch.from_lists(
                prompts=[ep.seg.prompt_ids for ep in eps],
                responses=[ep.seg.ids for ep in eps],
                logprobs=[ep.seg.logprobs for ep in eps],
                finish_reasons=[ep.finish for ep in eps],
                group_ids=[ep.group for ep in eps],
                pad_id=self.engine.pad_id,
            )
            rollout = Rollout(batch, [ep.last_action for ep in eps], torch.zeros(len(batch)), torch.arange(len(batch)))
        else:
            check_failures(eps, self.spec.limits)
            rollout = assemble(eps, self.spec.codec, self.engine.pad_id, self.spec.strict)
        return rollout, eps

    def _done(self, g: InFlight) -> bool:
        return g.done

    def close(self) -> None:
        """Nothing runs outside the step here (agent pools stop their endpoint)."""

    def _admit(self, version: int) -> None:
        lim = self.limits
        room = min(lim.in_flight, (lim.max_staleness + 1) * lim.groups_per_step)
        while len(self.pool) < room:
            if not self.queue:
                step, k = self.draws
                k = k + 1 if step == version else 0
                self.draws = (version, k)
                drawn = self.draw()
                positions = prompt_positions(len(drawn), k)
                self.queue = [(i, version, p) for i, p in zip(drawn, positions)]
            index, step, position = self.queue.pop(0)
            self.pool.append(InFlight(index, version, (step, position), self.admitted))
            self.admitted += 1

    def _pick(self, version: int) -> list[int] | None:
        """The pool indices to train now, or None (generate another round): the `groups_per_step`
        oldest finished groups, once every group due now is among them and every group left can
        still be trained by its deadline (at most j x groups_per_step due within the next j steps)."""
        lim, s = self.limits, self.limits.max_staleness
        b = lim.groups_per_step
        age = {i: (g.born, g.order) for i, g in enumerate(self.pool)}
        finished = sorted((i for i, g in enumerate(self.pool) if self._done(g)), key=age.__getitem__)
        if len(finished) < b:
            return None
        chosen = set(finished[:b])
        left = [g for i, g in enumerate(self.pool) if i not in chosen]
        if any(g.born + s <= version for g in left):
            return None
        for j in range(1, s + 1):  # after this step, versions version+1 .. version+s
            if sum(g.born + s <= version + j for g in left) > j * b:
                return None
        return sorted(chosen, key=age.__getitem__)

    def _needs_round(self, version: int) -> bool:
        """Whether to generate another round: this rank cannot pick yet; in a tensor-parallel group,
        whether any member cannot (the others take part, their own episodes going on meanwhile)."""
        need = self._pick(version) is None
        return self._group_any(need)

    def _group_any(self, flag: bool) -> bool:
        if self.engine.tp == 1:
            return flag
        return vdist.all_reduce_max(float(flag)) > 0

    def _round(self, version: int) -> int:
        """Where an episode could pause, one engine per rank: the stream (`_stream`). Otherwise one
        engine call for the new groups' first turn (n samples per prompt, seeded as the synchronous
        step) and one for the episodes going on (one request each), capped at `chunk_tokens` where
        an episode could pause (a tensor-parallel group: every member makes the calls any member
        makes, with the same cap); when every live group must train this step, nothing could pause
        and each call runs to the end of its turn (max_staleness 0: the synchronous step's calls).
        -> the decode steps it ran."""
        s = self.limits.max_staleness
        live = [g for g in self.pool if not self._done(g)]
        pause = self._group_any(any(g.born + s > version for g in live))
        if pause and self.engine.tp == 1:
            return self._stream(version, live)
        cap = self.limits.chunk_tokens if pause else None
        go = dict(sampling=self.sampling, run_seed=self.run_seed, spec=self.spec, cap=cap, version=version)
        fresh, steps = [g for g in live if not g.episodes], 0
        if self._group_any(bool(fresh)):
            eps, batched = self._start(fresh)
            batched = not self._group_any(not batched)  # one kind of request for the whole group
            steps += advance(self.engine, eps, batched=batched, **go)
        going = [ep for g in live if g not in fresh for ep in g.episodes if ep.live]
        self._tally.resent += sum(len(request(ep, self.sampling, self.run_seed, self.spec)[0]) for ep in going)
        if self._group_any(bool(going)):
            steps += advance(self.engine, going, **go)
        return steps

    def _start(self, fresh: list[InFlight]) -> tuple[list[Episode], bool]:
        """The new groups' episodes (`start_episodes`), and whether each group's first request can be
        one for its n samples."""
        examples = [self.prompts[g.index] for g in fresh]
        prompt_ids = [list(e["prompt_ids"]) for e in examples]
        eps, batched = start_episodes(examples, prompt_ids, self.sampling.n, self.spec, [g.key for g in fresh])
        for k, g in enumerate(fresh):
            g.episodes = eps[k * self.sampling.n : (k + 1) * self.sampling.n]
        return eps, batched

    def _stream(self, version: int, live: list[InFlight]) -> int:
        """Step-and-abort (one engine per rank): every live episode's request goes into one stream (a new
        group's n samples as one request seeded as the synchronous step seeds its prompt), the engine
        steps until this rank can pick and the stream is in its tail (`_cut`), a turn that ends goes
        to its environment and the episode's next turn joins the running batch at once; what still
        runs then is cut where it got, its tokens kept for the next step. -> the decode steps it ran."""
        smp, spec = self.sampling, self.spec
        stream = self.engine.stream(smp.temperature, smp.top_p, self.limits.chunk_tokens, smp.top_k)
        # the oldest first: the engine schedules in arrival order, and they are due soonest
        for ep in (ep for g in sorted(live, key=lambda g: (g.born, g.order)) for ep in g.episodes if ep.live):
            self._tally.resent += self._request(stream, ep)
        fresh = [g for g in live if not g.episodes]
        if fresh:
            eps, batched = self._start(fresh)
            for g in fresh if batched else ():
                head = g.episodes[0]
                _, budget, _ = request(head, smp, self.run_seed, spec)
                stream.add(g.episodes, head.seg.prompt_ids, budget, prompt_seed(self.run_seed, *head.key))
            for ep in () if batched else (ep for ep in eps if ep.live):
                self._request(stream, ep)
        while not self._cut(version, len(stream), stream.peak):
            for got in stream.step():
                take(got.key, got.ids, got.logprobs, got.finish, False, version, spec)
                if got.key.live:  # its environment answered: the next turn joins the running batch
                    self._request(stream, got.key)
        for got in stream.close():
            take(got.key, got.ids, got.logprobs, got.finish, True, version, spec)
        return stream.steps

    def _cut(self, version: int, running: int, peak: int) -> bool:
        """Whether a stream running `running` requests (at most `peak` so far) stops now: nothing runs,
        or this step can pick and the stream is in its tail (`tail_fraction` of its peak)."""
        if not running:
            return True
        return running <= self.limits.tail_fraction * peak and self._pick(version) is not None

    def _request(self, stream, ep: Episode) -> int:
        """`ep`'s next request into `stream`. -> its context's length."""
        context, budget, seed = request(ep, self.sampling, self.run_seed, self.spec)
        stream.add([ep], context, budget, seed)
        return len(context)

    def _metrics(self, eps: list[Episode], version: int) -> dict[str, float]:
        """partial/*, over the groups taken this step: how stale their tokens are (versions behind the
        weights that train them), the share of episodes that spanned several versions, the groups
        left in flight, the generation rounds and their decode steps (the engine steps of a stream;
        each engine call's longest output, added up: what a decode-bound GPU engine's generation
        time follows), and the context tokens re-sent for episodes going on (their KV recomputed:
        the prefill partial rollouts add)."""
        t = self._tally
        ages, spanned = t.ages, t.spanned
        ages += [version - v for ep in eps for v in ep.versions]
        spanned += [len(set(ep.versions)) > 1 for ep in eps]
        return {
            "partial/staleness/mean": sum(ages) / max(len(ages), 1),
            "partial/staleness/max": float(max(ages, default=0)),
            "partial/stale_token_fraction": sum(a > 0 for a in ages) / max(len(ages), 1),
            "partial/resumed_fraction": sum(spanned) / max(len(spanned), 1),
            "partial/in_flight_groups": float(len(self.pool)),
            "partial/rounds": float(t.rounds),
            "partial/decode_steps": float(t.decode),
            "partial/resent_tokens": float(t.resent),
        }

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Plain JSON: the pool, the drawn-but-not-admitted prompts, the counters. Logprobs are
        Python floats (exact in JSON: float32 values round-trip through repr). An environment is
        not saved: `load_state_dict` replays its episode's actions into a new one."""
        groups = [
            {**asdict(replace(g, episodes=[])), "episodes": [_episode_state(ep) for ep in g.episodes]}
            for g in self.pool
        ]
        queue = [list(q) for q in self.queue]
        return {"pool": groups, "queue": queue, "admitted": self.admitted, "draws": list(self.draws)}

    def load_state_dict(self, state: dict) -> None:
        self.pool = []
        for g in state["pool"]:
            group = InFlight(g["index"], g["born"], tuple(g["key"]), g["order"])
            group.episodes = [self._episode(e, self.prompts[group.index]) for e in g["episodes"]]
            self.pool.append(group)
        self.queue = [(int(i), int(step), int(pos)) for i, step, pos in state["queue"]]
        self.admitted = int(state["admitted"])
        self.draws = (int(state["draws"][0]), int(state["draws"][1]))

    def _episode(self, state: dict, example: dict) -> Episode:
        """An episode from its saved state; a live one's environment rebuilt by replaying its
        actions (environments are deterministic given the example, as their seeds make them)."""
        pending = state["pending"]
        ep = Episode(
            **{
                **state,
                "key": tuple(state["key"]),
                "env": None,
                "segments": [Segment(**seg) for seg in state["segments"]],
                "pending": Segment(**pending) if pending else None,
            }
        )
        if self.spec is not None and ep.live:
            ep.env = self.spec.env_factory()
            env_reset(ep.env, example)
            for action in ep.actions:
                env_step(ep.env, action)
        return ep


def _episode_state(ep: Episode) -> dict:
    state = {f.name: getattr(ep, f.name) for f in fields(ep) if f.name not in ("env", "segments", "pending")}
    return {
        **state,
        "segments": [asdict(seg) for seg in ep.segments],
        "pending": asdict(ep.pending) if ep.pending else None,
    }
