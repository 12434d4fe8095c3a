"""Engine calls for the agents' calls: requests that arrive together are generated in one engine call.

Synchronous rounds: one worker thread takes the queue, waits `batch_window_s` for more, and sends them
all (each with its own seed and budget; the call runs to the largest budget and each completion is
cut to its own). Rounds mode (partial rollouts): no worker thread; calls wait in the queue until the
trainer runs `round(cap, version)` or `stream_round(...)`, so a step can stop between engine calls
while agents wait on their calls, and go on after the weight sync.

The trainer owns sampling: temperature, top_p, the token budget and the seed are the scheduler's.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..engines.engine import RolloutEngine
from ..episodes import Sampling
from .protocol import RequestError, RunEnded
from .recorder import Call, Recorder, Track


@dataclass
class Job:
    track: Track
    call: Call
    seed: int
    budget: int
    future: concurrent.futures.Future
    continues: bool  # extends the track's last segment (False: a new row)
    ids: list[int] = field(default_factory=list)  # sampled so far (rounds mode: a call may pause at a cap)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class Scheduler:
    """The queue of calls over `engine`; each call's completion goes to `recorder` and then to the
    waiting handler (its job's future). `lock` is the server's: it guards the recorder and the queue's
    bookkeeping (pending counts, held calls)."""

    def __init__(
        self,
        engine: RolloutEngine,
        recorder: Recorder,
        lock: threading.Lock,
        sampling: Sampling,
        max_model_len: int,
        batch_window_s: float = 0.02,
        max_batch: int = 64,
        rounds: bool = False,
    ):
        self.engine, self.recorder, self.lock = engine, recorder, lock
        self.sampling, self.max_model_len = sampling, max_model_len
        self.batch_window_s, self.max_batch, self.rounds = batch_window_s, max_batch, rounds
        self.engine_calls: list[int] = []  # requests per engine call (how well calls were batched)
        self.changed = threading.Condition(lock)  # a call was queued, or `poke` (an agent ended)
        self.queue: queue.Queue = queue.Queue()
        self.held: list[Job] = []  # rounds mode: calls paused at the last round (its cap, or the stream cut there)
        self.closing = False
        self.worker: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if not self.rounds:
            self.worker = threading.Thread(target=self._work, name="agent-server-engine", daemon=True)
            self.worker.start()

    def close(self) -> None:
        """Rounds mode: no call is queued after this, and the calls waiting fail (their agents end)."""
        if self.rounds:
            with self.lock:
                self.closing = True
                jobs = self._take_waiting()
            self._fail(jobs, RunEnded())

    def join(self) -> None:
        """The worker generates and records what is queued, then ends."""
        if self.worker is not None:
            self.queue.put(None)
            self.worker.join()
            self.worker = None

    # ------------------------------------------------------------------ calls in
    def job(self, track: Track, call: Call, continues: bool) -> Job:
        """The call's budget (what is left under max_model_len) and seed; counted as pending. Under the lock."""
        if self.closing:
            raise RequestError(503, "the run is ending")
        budget = min(self.sampling.max_new_tokens, self.max_model_len - len(call.prompt_ids))
        if budget < 1:
            raise RequestError(
                400,
                f"the prompt is {len(call.prompt_ids)} tokens: no room left under max_model_len {self.max_model_len}",
            )
        seed = self.recorder.seed(track, track.calls)
        track.calls += 1
        track.pending += 1
        self.changed.notify_all()
        return Job(track, call, seed, budget, concurrent.futures.Future(), continues)

    def put(self, job: Job) -> None:
        self.queue.put(job)

    def settle(self) -> None:
        """Wait until every call taken has been generated and recorded (an agent cancelled at its
        timeout may leave its last call queued: its row must not change after it is assembled)."""
        while True:
            with self.lock:
                if all(t.pending == 0 for t in self.recorder.tracks.values()):
                    return
            time.sleep(0.01)

    # ------------------------------------------------------------------ rounds mode (partial rollouts)
    def _waiting(self, ids: list[str]) -> bool:
        """Every one of these episodes has a call queued or paused (its agent waits on the server). Under the lock."""
        tracks = self.recorder.tracks
        return all(tracks[e].pending > 0 for e in ids if e in tracks)

    def wait_until_waiting(self, live: Callable[[], list[str]], timeout: float) -> bool:
        """Block until every episode `live()` names waits on the server (`_waiting`), woken by each
        call queued and each `poke`, not by polling. -> False at the timeout."""
        with self.changed:
            return self.changed.wait_for(lambda: self._waiting(live()), timeout)

    def poke(self) -> None:
        """Wake `wait_until_waiting` (an agent ended without a call, so `live()` changed)."""
        with self.changed:
            self.changed.notify_all()

    def settled(self, ids: list[str]) -> bool:
        """None of these episodes has a call left to generate."""
        with self.lock:
            tracks = self.recorder.tracks
            return all(tracks[e].pending == 0 for e in ids if e in tracks)

    def round(self, cap: int | None, version: int) -> int:
        """Rounds mode: one engine call for every queued call and every call paused at the last
        round's cap, each generating the rest of its budget, or at most `cap` tokens (a call cut at
        the cap stays held and goes on at the next round, from its prompt and the ids sampled so far;
        its tokens keep the `version` that sampled them). Each request's seed: (run seed, its
        episode's step, position and sample, the episode's request count), so a call that is not
        cut draws what the synchronous round draws. -> the call's decode steps (its longest output)."""
        with self.lock:
            jobs = self._take_waiting()
            seeds = [self._request_seed(j) for j in jobs]
        return self._generate(jobs, seeds, cap, version) if jobs else 0

    def stream_round(self, chunk: int, version: int, cut: Callable[[int, int], bool], react: Callable[[], None]) -> int:
        """Rounds mode, step-and-abort: every queued or held call goes into one engine stream
        (`RolloutEngine.stream`), stepped until `cut(running, peak)` (the calls it runs now, the most
        it ran). Each call that ends is recorded and answered, `react()` waits until the agents have
        acted on the answers, and the calls they make join the running batch; the calls still running
        when it stops are held where they got (their tokens tagged `version`), to go on at the next
        round. Seeds as `round`. -> its engine steps."""
        stream = self.engine.stream(self.sampling.temperature, self.sampling.top_p, chunk, self.sampling.top_k)
        self._enter(stream)
        while not cut(len(stream), stream.peak):
            self.engine_calls.append(len(stream))
            ended = stream.step()
            if ended:
                self._answer([(got.key, got.ids, got.logprobs, got.finish, False) for got in ended], version)
                react()
                self._enter(stream)
        self._answer([(got.key, got.ids, got.logprobs, got.finish, True) for got in stream.close()], version)
        return stream.steps

    def _enter(self, stream) -> None:
        """Every queued and held call into `stream`, each from its prompt and the ids it sampled so far."""
        with self.lock:
            for j in self._take_waiting():
                stream.add([j], j.call.prompt_ids + j.ids, j.budget - len(j.ids), self._request_seed(j))

    def _take_waiting(self) -> list[Job]:
        """The calls held at the last round, then those queued since. Under the lock."""
        jobs, self.held = self.held + self._drain(), []
        return jobs

    def _request_seed(self, j: Job) -> int:
        """The seed of `j`'s next engine request (the recorder's seed over its episode's request
        count, counted here). Under the lock."""
        seed = self.recorder.seed(j.track, j.track.requests)
        j.track.requests += 1
        if not j.ids:  # the seed the response reports: its first request's
            j.seed = seed
        return seed

    def _drain(self) -> list[Job]:
        jobs = []
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return jobs
            if job is not None:
                jobs.append(job)

    def _fail(self, jobs: list[Job], e: Exception) -> None:
        with self.lock:
            for j in jobs:
                j.track.pending -= 1
        for j in jobs:
            j.future.set_exception(e)

    # ------------------------------------------------------------------ engine calls
    def _work(self) -> None:
        """The engine's one thread: take what is queued (waiting `batch_window_s` for more), one
        engine call for all of it."""
        while True:
            first = self.queue.get()
            if first is None:
                return
            jobs, stop = [first], False
            deadline = time.monotonic() + self.batch_window_s
            while len(jobs) < self.max_batch:
                try:
                    job = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                    break
                jobs.append(job)
            self._generate(jobs, [j.seed for j in jobs], None, self.recorder.step)
            if stop:
                return

    def _generate(self, jobs: list[Job], seeds: list[int], cap: int | None, version: int) -> int:
        """One engine call for `jobs`, from each call's prompt and the ids it sampled so far: each
        generates the rest of its budget, or at most `cap` tokens (a call cut there is held for the
        next round); the calls that end are recorded and answered; tokens are tagged `version`.
        -> the call's decode steps (its longest output)."""
        asks = [j.budget - len(j.ids) if cap is None else min(cap, j.budget - len(j.ids)) for j in jobs]
        try:
            out = self.engine.generate(
                [j.call.prompt_ids + j.ids for j in jobs],
                1,
                temperature=self.sampling.temperature,
                top_p=self.sampling.top_p,
                max_new_tokens=max(asks),
                seeds=seeds,
                top_k=self.sampling.top_k,
            )
            rows = out.to_lists()
        except Exception as e:
            self._fail(jobs, e)
            return 0
        self.engine_calls.append(len(jobs))
        results = []
        for j, ask, ids, lps, reason in zip(jobs, asks, rows["responses"], rows["logprobs"], rows["finish_reasons"]):
            if len(ids) > ask:  # this call's own limit (the engine ran to the largest one)
                ids, lps, reason = ids[:ask], lps[:ask], "length"
            paused = cap is not None and reason != "stop" and len(j.ids) + len(ids) < j.budget  # goes on next round
            results.append((j, ids, lps, reason, paused))
        self._answer(results, version)
        return max((len(ids) for ids in rows["responses"]), default=0)

    def _answer(self, results: list[tuple], version: int) -> None:
        """Each `(job, new ids, their logprobs, finish reason, paused)`: the tokens tagged `version`; a
        paused call is held for the next round, the others recorded and answered."""
        done = []
        with self.lock:
            for j, ids, lps, reason, paused in results:
                j.ids, j.logprobs, j.versions = j.ids + ids, j.logprobs + lps, j.versions + [version] * len(ids)
                if paused:
                    self.held.append(j)
                    continue
                self.recorder.record(j.track, j.call, j.continues, j.ids, j.logprobs, reason)
                j.track.versions += j.versions
                j.track.pending -= 1
                done.append(j)
        for j in done:
            j.future.set_result(None)
