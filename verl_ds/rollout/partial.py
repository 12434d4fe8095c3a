"""Partial rollouts: a step trains on groups that have finished and does not wait for the slowest.

Each rank keeps a pool of prompt groups in flight across steps. A step generates in rounds of at
most `chunk_tokens` new tokens per episode; once it can train `groups_per_step` finished groups it
stops, and the unfinished episodes stay in the pool with their ids, rollout logprobs and, per
token, the weights version that sampled it. After the weight sync they continue from their ids on
the new weights (the engine recomputes their KV), so one response may span several versions. The
loss corrects for that with the truncated importance weight on the rollout logprobs
(`algorithm.tis_cap`: decoupled PPO, the proximal policy being the weights the step starts from).

Staleness is bounded by admission, never by dropping work: a group admitted at version v is
trained at a version <= v + max_staleness. The pool holds at most (max_staleness + 1) x
groups_per_step untrained groups, and a step trains the oldest finished groups first, stopping
only when what stays in the pool can still be trained in time (earliest-deadline-first: for every
later step j, the groups due by then fit in j steps' batches). With max_staleness 0 no group
outlives its step and every round runs to the full budget, so the step is the synchronous one,
bitwise.

Seeds: a new group's first round samples its n episodes in one request seeded as the synchronous
step seeds that prompt; a continuation is one request per episode seeded from (run seed, the
group's step and position, sample, round) (`turn_seed`), so a resumed run continues identically.
Single-turn episodes, one engine per rank (tensor parallel size 1); `state_dict` holds everything
a checkpoint needs to resume the pool exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from .batch import RolloutBatch
from .distributed import prompt_positions
from .engine import RolloutEngine
from .episodes import Rollout, Sampling
from .seeding import prompt_seed, turn_seed


@dataclass
class InFlight:
    """One prompt's group: its `n` episodes as far as they got. `key` = (step, position) seeds it."""

    index: int  # the prompt's index in the data
    born: int  # the weights version (step) it was admitted at
    key: tuple[int, int]
    order: int  # admission order on this rank (ties in age)
    ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)  # per token: the version that sampled it
    finish: list[str] = field(default_factory=list)  # "" while the episode runs, then stop | length
    rounds: list[int] = field(default_factory=list)  # continuation requests sent per episode

    @property
    def done(self) -> bool:
        return bool(self.finish) and all(self.finish)


@dataclass(frozen=True)
class PartialLimits:
    groups_per_step: int  # this rank's groups trained per step
    max_staleness: int  # versions between a group's admission and its training, at most
    in_flight: int  # groups in the pool at most (over-provisioning)
    chunk_tokens: int  # new tokens per episode per round


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
    ):
        self.engine, self.limits, self.prompts, self.draw = engine, limits, prompts, draw
        self.n, self.max_new_tokens = sampling.n, sampling.max_new_tokens
        self.sample = dict(temperature=sampling.temperature, top_p=sampling.top_p)
        self.run_seed = run_seed
        self.pool: list[InFlight] = []
        self.queue: list[tuple[int, int, int]] = []  # (prompt index, draw step, position) not yet admitted
        self.admitted = 0
        self.draws: tuple[int, int] = (-1, 0)  # (step, draws in that step): the next draw's round

    # ---------------------------------------------------------------- one step
    def collect(self, version: int) -> tuple[Rollout, list[dict]]:
        """Admit, generate rounds until `groups_per_step` groups can train, take them out of the pool.
        -> (their rows, contiguous per group, with partial/* metrics; the groups' examples)."""
        self._admit(version)
        rounds = 0
        while (picked := self._pick(version)) is None:
            self._round(version)
            rounds += 1
        taken = [self.pool[i] for i in picked]
        self.pool = [g for i, g in enumerate(self.pool) if i not in set(picked)]
        batch = self._rows(taken)
        final = [ids for g in taken for ids in g.ids]
        metrics = self._metrics(taken, version, rounds)
        rollout = Rollout(batch, final, torch.zeros(len(batch)), torch.arange(len(batch)), metrics)
        return rollout, [self.prompts[g.index] for g in taken]

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
        finished = sorted((i for i, g in enumerate(self.pool) if g.done), key=age.__getitem__)
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

    def _round(self, version: int) -> None:
        """One engine call for new groups (n samples per prompt, seeded as the synchronous step) and
        one for continuing episodes (one request each). When every live group must train this step,
        nothing could pause, so the round runs to the full budget."""
        s = self.limits.max_staleness
        live = [g for g in self.pool if not g.done]
        chunk = self.limits.chunk_tokens
        if all(g.born + s <= version for g in live):
            chunk = self.max_new_tokens
        fresh = [g for g in live if not g.finish]
        if fresh:
            out = self.engine.generate(
                [self._prompt(g) for g in fresh],
                n=self.n,
                max_new_tokens=min(chunk, self.max_new_tokens),
                seeds=[prompt_seed(self.run_seed, *g.key) for g in fresh],
                **self.sample,
            ).to_lists()
            rows = iter(zip(out["responses"], out["logprobs"], out["finish_reasons"]))
            for g in fresh:
                g.ids, g.logprobs, g.versions, g.finish, g.rounds = [], [], [], [], [0] * self.n
                for _ in range(self.n):
                    ids, lps, reason = next(rows)
                    g.ids.append(ids)
                    g.logprobs.append(lps)
                    g.versions.append([version] * len(ids))
                    g.finish.append(self._finish(len(ids), reason))
        going = [(g, j) for g in live if g not in fresh for j in range(self.n) if not g.finish[j]]
        if going:
            budgets = [min(chunk, self.max_new_tokens - len(g.ids[j])) for g, j in going]
            out = self.engine.generate(
                [self._prompt(g) + g.ids[j] for g, j in going],
                n=1,
                max_new_tokens=max(budgets),
                seeds=[turn_seed(self.run_seed, *g.key, j, g.rounds[j] + 1) for g, j in going],
                **self.sample,
            ).to_lists()
            for (g, j), budget, ids, lps, reason in zip(
                going, budgets, out["responses"], out["logprobs"], out["finish_reasons"]
            ):
                if len(ids) > budget:  # this episode's own budget (the call ran to the largest one)
                    ids, lps, reason = ids[:budget], lps[:budget], "length"
                g.ids[j] += ids
                g.logprobs[j] += lps
                g.versions[j] += [version] * len(ids)
                g.rounds[j] += 1
                g.finish[j] = self._finish(len(g.ids[j]), reason)

    def _prompt(self, g: InFlight) -> list[int]:
        return list(self.prompts[g.index]["prompt_ids"])

    def _finish(self, length: int, reason: str) -> str:
        """stop (the model ended it) | length (the whole budget used) | "" (paused at a round's end)."""
        if reason == "stop":
            return "stop"
        return "length" if length >= self.max_new_tokens else ""

    def _rows(self, groups: list[InFlight]) -> RolloutBatch:
        n = self.n
        return RolloutBatch.from_lists(
            prompts=[self._prompt(g) for g in groups for _ in range(n)],
            responses=[ids for g in groups for ids in g.ids],
            logprobs=[lp for g in groups for lp in g.logprobs],
            finish_reasons=[f for g in groups for f in g.finish],
            group_ids=[i for i in range(len(groups)) for _ in range(n)],
            pad_id=self.engine.pad_id,
        )

    def _metrics(self, taken: list[InFlight], version: int, rounds: int) -> dict[str, float]:
        """partial/*: how stale the trained tokens are (versions behind the weights that train them),
        the share of episodes that spanned several versions, what stays in flight."""
        ages = [version - v for g in taken for vs in g.versions for v in vs]
        spanned = [len(set(vs)) > 1 for g in taken for vs in g.versions]
        return {
            "partial/staleness/mean": sum(ages) / max(len(ages), 1),
            "partial/staleness/max": float(max(ages, default=0)),
            "partial/stale_token_fraction": sum(a > 0 for a in ages) / max(len(ages), 1),
            "partial/resumed_fraction": sum(spanned) / max(len(spanned), 1),
            "partial/in_flight_groups": float(len(self.pool)),
            "partial/rounds": float(rounds),
        }

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Plain JSON: the pool, the drawn-but-not-admitted prompts, the counters. Logprobs are
        Python floats (exact in JSON: float32 values round-trip through repr)."""
        return {
            "pool": [asdict(g) for g in self.pool],
            "queue": [list(q) for q in self.queue],
            "admitted": self.admitted,
            "draws": list(self.draws),
        }

    def load_state_dict(self, state: dict) -> None:
        self.pool = [InFlight(**{**g, "key": tuple(g["key"])}) for g in state["pool"]]
        self.queue = [(int(i), int(step), int(pos)) for i, step, pos in state["queue"]]
        self.admitted = int(state["admitted"])
        self.draws = (int(state["draws"][0]), int(state["draws"][1]))
