"""Rollout ranks apart (`trainer.rollout_ranks`): the trainer rank's side of the stream.

`RemoteRollout` is the rollout engine the loop sees on a trainer rank. Its rows come from a rollout
rank (`trainer/rollout_rank.py`) over the launch's `dist.Bridge`, in the order the loop asks for
them: each step's batch, then the sync's probe. The rollout rank draws the same prompts and seeds the
colocated rank would (the same sampler, `prompt_seeds` at this trainer rank's positions), so the loop
runs unchanged; what it asks for is checked against what came (`asked`), so two samplers that part
are one line, not a silent mismatch. The weights go the other way after every optimizer step, from
trainer rank 0 to every rollout rank, without waiting (`Bridge.isend`): only the tensors' changed
elements where that is fewer bytes than the tensor (`changed_elements`).

Messages come in the rollout rank's order, and the loop may ask out of it: validation after step k asks
for rows the rollout rank samples once the weights of step k land, behind the rows of step k + 1 and
the next probe it already sent; those are held until asked for.

A checkpoint after step k holds the rows of step k its rollout rank already sampled on the weights of
step k - 1 (`state_dict` takes them off the stream; the rollout rank samples one step past the last, so a
finished run's final checkpoint has them too): a resume trains exactly the rows the run would have.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Iterable

import torch

from verl_ds.dist import failure_text, peer_lost
from verl_ds.errors import RunFailure

from ..batch import RolloutBatch


def as_message(batch: RolloutBatch) -> dict:
    """A batch as plain data for the bridge."""
    return dict(vars(batch))


def changed_elements(now: torch.Tensor, before: torch.Tensor | None) -> torch.Tensor | dict:
    """What a rollout rank that holds `before` needs to hold `now`: the indices and values of the
    elements whose bits changed, or `now` itself where that is fewer bytes (or nothing was held)."""
    if before is None or before.shape != now.shape or before.dtype != now.dtype:
        return now
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[now.element_size()]
    idx = (now.view(bits) != before.view(bits)).flatten().nonzero().flatten()
    idx = idx.to(torch.int32) if now.numel() < 2**31 else idx  # 4 bytes an index where they fit
    if idx.numel() * (idx.element_size() + now.element_size()) >= now.numel() * now.element_size():
        return now
    return {"idx": idx, "val": now.flatten()[idx]}


def apply_changes(held: torch.Tensor | None, part: torch.Tensor | dict) -> torch.Tensor:
    """`changed_elements` undone: the tensor the sender holds."""
    if isinstance(part, torch.Tensor):
        return part
    out = held.clone()
    out.view(-1)[part["idx"].long()] = part["val"]
    return out


def part_bytes(part: torch.Tensor | dict) -> int:
    if isinstance(part, torch.Tensor):
        return part.numel() * part.element_size()
    return sum(t.numel() * t.element_size() for t in part.values())


class RemoteRollout:
    """A trainer rank's rollout engine when rollout ranks run apart (the `RolloutEngine` members the loop
    uses): `answer` takes the next episodes its rollout rank ran (a step's, or validation's:
    `episodes.collect_remote`), `generate` the sync probe's rows, `sync_weights` sends the step's weights
    (trainer rank 0; the others take part in the gathers only)."""

    tp = 1  # the rollout rank's engine serves this rank alone, as far as this rank can tell
    start_s = 0.0

    def __init__(self, bridge, trainer_rank: int, pad_id: int, steps: int):
        self.bridge, self.rank = bridge, trainer_rank
        self.server = bridge.rollout_rank_of(trainer_rank)
        self.sender = trainer_rank == 0
        self.pad_id, self.steps = pad_id, steps
        self.last_metrics: dict[str, float] = {}
        self._sent: dict[str, torch.Tensor] = {}  # what the rollout ranks hold, as last sent (trainer rank 0)
        self.version = 0  # the weights last sent: the optimizer steps they have taken
        self.taken = 0  # steps' rows taken off the stream
        self._held: deque[dict] = deque()  # messages taken off the stream ahead of their ask, in order

    def connect(self, handshake: dict) -> RemoteRollout:
        """Trainer rank 0 tells every rollout rank what to serve (`handshake`: the model, its dtype and
        engine, the prompts); every trainer rank then waits for rows."""
        if self.sender:
            for r in range(self.bridge.trainers, self.bridge.size):
                self.bridge.send(handshake, r)
        return self

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 16,
        seeds: list[int] | None = None,
        top_k: int = 0,
    ) -> RolloutBatch:
        asked = dict(
            prompts=[list(p) for p in prompt_token_ids],
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            seeds=list(seeds or []),
            top_k=top_k,
        )
        return RolloutBatch(**self._take(lambda m: m["asked"] == asked, asked)["batch"])  # the probe's

    def answer(self, asked: dict) -> dict:
        """The message that answers `asked`: the episodes the rollout rank ran for this trainer rank (a step's,
        or validation's: `episodes.collect_remote` asks and reads it)."""
        t0 = time.perf_counter()
        msg = self._take(lambda m: m["asked"] == asked, asked)
        if msg["kind"] == "rows":  # a step's rows (validation's carry none: the step's stay)
            self.last_metrics = {**msg["metrics"], "timing_s/rows_wait": time.perf_counter() - t0}
        return msg

    def _take(self, wanted, asked: dict | None = None, keep: bool = False) -> dict:
        """The first message `wanted` picks, held or off the stream (those before it held, in order);
        `keep`: it stays held (a checkpoint's look at the next rows). Only a step's rows and probe wait for
        an ask that comes later (validation's): the rollout rank sends up to the rows of the step after the
        last weights sent, then waits for the next weights, so a message not among those never comes. Either
        way the two sides parted: one line, not a wait until the collective timeout."""
        for i, msg in enumerate(self._held):
            if wanted(msg):
                if not keep:
                    del self._held[i]
                return msg
        while self.taken < self.version + 2:  # rows 0 .. version + 1 can come without new weights
            msg = self._recv()
            if wanted(msg):
                if keep:
                    self._held.append(msg)
                return msg
            if msg["kind"] == "val":
                self._parted(msg, asked)
            self._held.append(msg)
        self._parted(self._held[0] if self._held else None, asked)

    def _parted(self, msg: dict | None, asked: dict | None):
        got = msg["asked"] if msg else {}
        differ = sorted(k for k in asked if got.get(k) != asked[k]) if asked else ["no step's rows"]
        raise RunFailure(
            f"rollout rank {self.server} sent {msg['kind'] if msg else 'nothing'} for other requests than trainer "
            f"rank {self.rank} asks for ({', '.join(differ)} differ): the two sides' samplers parted"
        )

    def _recv(self) -> dict:
        msg = self._over_bridge(self.bridge.recv, self.server)
        self.taken += msg["kind"] == "rows"
        return msg

    def _over_bridge(self, op, *args):
        """A bridge operation; the rollout rank gone (a rank the trainers' roll call cannot see) is
        one line naming it."""
        try:
            return op(*args)
        except Exception as e:
            if not peer_lost(e):
                raise
            raise RunFailure(
                f"rollout rank {self.server} is gone: trainer rank {self.rank} lost the stream "
                f"({type(e).__name__}: {failure_text(e)})"
            ) from None

    def state_dict(self) -> dict:
        """The next step's rows (already sampled: taken off the stream now) as `RolloutBatch.to_lists` JSON
        (float32 logprobs round-trip exactly through their Python floats), and the weights' version."""
        msg = self._take(lambda m: m["kind"] == "rows", keep=True)
        batch = RolloutBatch(**msg["batch"])
        rows = {**batch.to_lists(), "pad_id": batch.pad_id}
        return {"next": {**msg, "batch": rows}, "version": self.version, "taken": self.taken}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's next rows, trained at the next step; the resume's sync then re-sends the
        checkpoint's weights under their own version (the rollout rank starts from the model's)."""
        msg = state["next"]
        self._held = deque([{**msg, "kind": "rows", "batch": as_message(RolloutBatch.from_lists(**msg["batch"]))}])
        # a checkpoint after step k has taken rows 0 .. k and sent the weights of step k; the resume's sync
        # sends them again, so it counts from one before (every trainer rank: checkpoints before they all
        # counted saved 0 on the others)
        self.taken = state["taken"]
        self.version = self.taken - 2

    def stream(self, temperature: float, top_p: float, chunk_tokens: int, top_k: int = 0):
        raise NotImplementedError("rollout ranks apart stream whole steps (config refuses rollout.partial)")

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Trainer rank 0: the step's weights to every rollout rank, each tensor's changed elements where
        fewer bytes, sent without waiting (the previous step's taken first); the other trainer ranks
        drain the iterator (its gathers are collective)."""
        t0 = time.perf_counter()
        self.version += 1  # every trainer rank counts them: what its rollout rank can send before the next
        if not self.sender:
            for _ in named_tensors:
                pass
            return {}
        self._over_bridge(self.bridge.wait)  # the previous weights reached every rollout rank
        wait_s = time.perf_counter() - t0
        parts, full, sent = {}, 0, 0
        for name, tensor in named_tensors:
            now = tensor.detach().to("cpu", copy=True)
            parts[name] = changed_elements(now, self._sent.get(name))
            self._sent[name] = now
            full += now.numel() * now.element_size()
            sent += part_bytes(parts[name])
        for r in range(self.bridge.trainers, self.bridge.size):
            self._over_bridge(self.bridge.isend, {"version": self.version, "tensors": parts}, r)
        return {
            "timing_s/update_weights": time.perf_counter() - t0,
            "timing_s/weights_wait": wait_s,
            "sync/bytes_full": float(full),
            "sync/bytes_sent": float(sent),
        }

    def sleep(self, level: int) -> None:  # the engine is on another rank
        pass

    def wake_up(self) -> None:
        pass

    def shutdown(self, release: bool = True) -> None:
        if self.taken < self.steps:  # ended early (a failure): the rollout rank is blocked sending rows this
            return  # rank will not take, and waits for weights that will not come; the launcher ends it
        if self.taken == self.steps:  # the run ended without a final checkpoint: the rows sampled past the
            self._take(lambda m: m["kind"] == "rows", keep=True)  # last step still come (their send waits)
        if self.sender:
            self._over_bridge(self.bridge.wait)  # the last weights reach the rollout ranks, which end on them
