"""Agents as they are: an OpenAI-compatible `/v1/chat/completions` (and `/v1/completions`) endpoint
that records tokens.

An agent written against the `openai` client talks to `AgentServer` (FastAPI under uvicorn, in a
background thread, bound to 127.0.0.1 on a free port, every request carrying the run's secret). The
server renders the messages with the model's chat template (the `ChatCodec`), generates with the
rollout engine, and answers in OpenAI's shape plus the ids it fed and sampled.

A call goes, in one direction: the HTTP surface (`endpoint.py`: the key, the body, the answer's
shape) -> `AgentServer.submit_chat` (the request's messages, `protocol.py`) -> the recorder
(`recorder.py`: the call's ids, continuing the episode's row or forking one) -> the scheduler
(`scheduler.py`: its budget and seed, the queue, one engine call for the calls that arrive together)
-> the recorder again (the completion appended to the row) -> the answer.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from typing import Callable

from ..engines.engine import RolloutEngine
from ..episodes import Sampling, SeedKey
from . import protocol
from .endpoint import chat_response, make_app, text_response
from .recorder import Recorder, Track
from .scheduler import Job, Scheduler

ONE_SAMPLE = Sampling(n=1, temperature=1.0, top_p=1.0, max_new_tokens=64)


class AgentServer:
    """The endpoint over `engine` (a `RolloutEngine`) and `codec` (a `ChatCodec` with a chat
    template). `start()` binds 127.0.0.1 on a free port; `base_url` and `api_key` are what a client
    needs. `begin(...)` opens a round of episodes with its sampling and seeds, `take()` hands back
    their records.

    `rounds=True` (partial rollouts): no worker thread; calls wait in the queue until the trainer
    runs `scheduler.round(cap, version)`, so a step can stop between engine calls while agents wait on
    their calls, and go on after the weight sync. `add(...)` registers episodes without dropping others."""

    def __init__(
        self,
        engine: RolloutEngine,
        codec,
        sampling: Sampling = ONE_SAMPLE,
        max_model_len: int = 256,
        batch_window_s: float = 0.02,
        max_batch: int = 64,
        api_key: str | None = None,
        tool_parser: Callable[[str], list] | None = None,
        rounds: bool = False,
    ):
        if not codec.use_template:
            raise ValueError("the agent endpoint renders chat messages: the codec needs a chat template")
        codec.check_turns()
        self.engine, self.codec = engine, codec
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.lock = threading.Lock()  # the recorder's tracks and the scheduler's bookkeeping
        self.recorder = Recorder(codec, tool_parser)
        self.scheduler = Scheduler(
            engine, self.recorder, self.lock, sampling, max_model_len, batch_window_s, max_batch, rounds
        )
        self._server = self._thread = None
        self.host, self.port = "127.0.0.1", 0

    # ------------------------------------------------------------------ lifecycle
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def engine_calls(self) -> list[int]:
        """Requests per engine call (how well calls were batched)."""
        return self.scheduler.engine_calls

    def start(self) -> AgentServer:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))  # loopback only: the endpoint serves this machine's agents
        self.port = sock.getsockname()[1]
        app = make_app(
            self.api_key,
            {
                "/v1/chat/completions": (self.submit_chat, self.respond_chat),
                "/v1/completions": (self.submit_text, self.respond_text),
            },
        )
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self.scheduler.start()
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="agent-server-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent endpoint did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving; requests already queued are generated and recorded first (rounds mode: they
        fail, so the agents waiting on them end and the server can drain)."""
        if self._server is None:
            return
        self.scheduler.close()
        self._server.should_exit = True
        self._thread.join()
        self.scheduler.join()
        self._server = None

    def __enter__(self) -> AgentServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ episodes
    def begin(self, sampling: Sampling, seed: SeedKey, episodes: dict[str, tuple[int, int]]) -> None:
        """A new round sampled as `sampling`: earlier episodes are dropped; `episodes` maps each id to
        (its prompt's global position, its sample index), what its calls' seeds derive from; an
        unknown id gets a position from its hash."""
        with self.lock:
            self.scheduler.sampling = sampling
            self.recorder.begin(seed.run_seed, seed.step, episodes)
            self.scheduler.engine_calls.clear()

    def add(self, run_seed: int, episodes: dict[str, tuple[int, int, int]]) -> None:
        """Rounds mode: register episodes, each id -> (its prompt's step, global position, sample):
        what its requests' seeds derive from, whenever they run."""
        with self.lock:
            self.recorder.add(run_seed, episodes)

    def take(self, ids: list[str]) -> dict[str, Track]:
        """These episodes' records, forgotten here (others stay: rounds mode keeps episodes in
        flight; a round's `begin` drops what is left)."""
        with self.lock:
            return self.recorder.take(ids)

    # ------------------------------------------------------------------ calls (the endpoint's handlers)
    def submit_chat(self, episode: str, body: dict) -> Job:
        """A chat call: its messages, its tools' codec, its ids (continue or fork), queued."""
        with self.lock:
            messages = protocol.messages(body.get("messages"), self.recorder.replies)
            tools = self.recorder.tools_key(body.get("tools"))
            job = self.scheduler.job(*self.recorder.chat_call(episode, messages, tools))
        self.scheduler.put(job)
        return job

    def submit_text(self, episode: str, body: dict) -> Job:
        """A completions call: its prompt as text or ids, its ids (continue or fork), queued."""
        text, ids = protocol.text_prompt(body.get("prompt"))
        with self.lock:
            job = self.scheduler.job(*self.recorder.text_call(episode, text, ids))
        self.scheduler.put(job)
        return job

    def respond_chat(self, job: Job, body: dict) -> dict:
        call = job.call
        content, calls = call.messages[-1]["content"], []
        if call.tools and call.finish == "stop":  # a reply cut at its budget has no whole call
            content, calls = protocol.tool_calls(content, self.recorder.tool_parser)
            with self.lock:
                self.recorder.remember_replies(job.track, call.messages[-1]["content"], [c["id"] for c in calls])
        return chat_response(job, body, self.scheduler.sampling, content, calls)

    def respond_text(self, job: Job, body: dict) -> dict:
        return text_response(job, body, self.scheduler.sampling, self.codec.action_text(job.call.ids))
