"""Agents as they are: an OpenAI-compatible `/v1/chat/completions` (and `/v1/completions`) endpoint
that records tokens.

An agent written against the `openai` client talks to `AgentServer` (FastAPI under uvicorn, in a
background thread, bound to 127.0.0.1 on a free port, every request carrying the run's secret as
`Authorization: Bearer <key>`). Each request names its episode in the `X-Episode-Id` header. The
server renders the messages with the model's chat template (the `ChatCodec`), generates with the
rollout engine, and answers in OpenAI's shape plus the ids it fed and sampled
(`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`).

Token-exact rows, as the environment path (`episodes.py`) builds them: a call whose conversation
continues the episode's previous call (its messages, then the assistant reply the server sent, then
new messages) is fed the previous call's ids + the reply's sampled ids + the new messages' ids
(`ChatCodec.observation_ids`), so the model's tokens are never re-tokenized from text; the ids in
between are environment tokens (loss mask 0), the completion is the model's (mask 1, its rollout
logprobs). A call whose one-shot rendering extends the previous call's ids as ids also continues.
Any other call (the agent edited or dropped history) starts a new row: a fork.

The trainer owns sampling: temperature, top_p, the token budget and the seed are the server's;
a client's differing values are listed in the response's `verl_ds.overridden`. Requests that
arrive together are generated in one engine call: one worker thread takes the queue, waits
`batch_window_s` for more, and sends them all (each with its own seed and budget; the call runs to
the largest budget and each completion is cut to its own).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import logging
import queue
import secrets
import socket
import ssl
import threading
import time
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from fastapi import FastAPI, Request  # module level: FastAPI resolves the handler's annotations here
from fastapi.responses import JSONResponse

from verl_ds import dist as vdist
from verl_ds.errors import ConfigError, RunFailure, callable_name, real_number, shown

from .distributed import GroupLeader, follow, prompt_positions
from .engine import RolloutEngine
from .episodes import Episode, Rollout, Sampling, SeedKey, Segment, assemble
from .seeding import turn_seed

log = logging.getLogger(__name__)

EPISODE_HEADER = "X-Episode-Id"
# client parameters the trainer owns: its value is used, the client's (when it differs) reported
_OWNED = ("temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "n")
# accepted and not applied yet (reported in `verl_ds.ignored`)
_IGNORED = ("stop", "tool_choice", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty")


class RunEnded(Exception):
    """A call still waiting when the endpoint stops (rounds mode): it fails, quietly."""


class RequestError(Exception):
    """A request the server cannot serve: answered with `status` and the message, never raised out."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class _Call:
    prompt_ids: list[int]
    messages: list[dict]  # the request's conversation, the assistant reply appended once generated
    tools: str | None = ""  # the request's tools (JSON), a row continues only under the same; None: a
    # `/v1/completions` call (a text prompt, `messages` empty)
    text: str = ""  # a completions call: its prompt text, then its reply's text appended
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = "stop"


@dataclass
class _Track:
    """One episode's calls and the rows they built."""

    position: int  # seeds: its prompt's global position in the step (`prompt_positions`)
    sample: int  # seeds: 0 .. n-1 among its prompt's episodes
    step: int | None = None  # seeds: the step its prompt was drawn at (None: the server's round)
    segments: list[Segment] = field(default_factory=list)
    last: _Call | None = None  # the previous finished call, what the next may continue
    calls: int = 0
    pending: int = 0  # calls taken, not yet generated (a concurrent call cannot continue them)
    last_action: list[int] = field(default_factory=list)
    segment_tools: list[str | None] = field(default_factory=list)  # per row: its tools (None: a text row)
    segment_finish: list[str] = field(default_factory=list)  # per row: how its last call ended
    requests: int = 0  # engine requests made for it (rounds mode: later requests' seeds count them)
    versions: list[int] = field(default_factory=list)  # per model token, the weights version that sampled it
    reply_ids: list[str] = field(default_factory=list)  # its replies' tool call ids (forgotten with it)

    @property
    def finish(self) -> str:
        """How the episode's last call ended."""
        return self.segment_finish[-1] if self.segment_finish else "stop"


@dataclass
class _Job:
    track: _Track
    call: _Call
    seed: int
    budget: int
    future: concurrent.futures.Future
    continues: bool  # extends the track's last segment (False: a new row)
    ids: list[int] = field(default_factory=list)  # sampled so far (rounds mode: a call may pause at a cap)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def _text(content) -> str:
    """A message's content as text: a string, or OpenAI's list of parts (text parts only)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(400, "only text message content is supported")


def _text_prompt(raw) -> tuple[str | None, list[int] | None]:
    """A completions request's `prompt` as (text, None) or (None, token ids): one prompt per request
    (the episode's next turn), given as a string or a list of ids (or a list holding one of them)."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]
    if isinstance(raw, str):
        return raw, None
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw):
        return None, list(raw)
    raise RequestError(400, "`prompt` must be one string or one list of token ids (one prompt per request)")


def _messages(raw, replies: dict[str, str]) -> list[dict]:
    """A request's messages as the template renders them: text content; a `tool` result as a tool
    message; an assistant message with `tool_calls` as the text its model sampled (`replies`: tool
    call id -> the reply's text, for calls this server answered) or, for calls it did not write, the
    hermes text of those calls."""
    if not isinstance(raw, list) or not raw:
        raise RequestError(400, "`messages` must be a non-empty list")
    out = []
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, "each message needs a `role`")
        calls = m.get("tool_calls")
        if calls:
            out.append({"role": m["role"], "content": _tool_call_text(m, calls, replies)})
        else:
            out.append({"role": m["role"], "content": _text(m.get("content"))})
    return out


def _tool_call_text(message: dict, calls, replies: dict[str, str]) -> str:
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise RequestError(400, "`tool_calls` must be a list of objects")
    sent = {replies.get(str(c.get("id"))) for c in calls}
    if len(sent) == 1 and None not in sent:  # the reply as sampled: its ids continue the row
        return sent.pop()
    parts = [_text(message.get("content"))] if message.get("content") else []
    for c in calls:
        fn = c.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            raise RequestError(400, "a tool call's `arguments` must be a JSON string") from None
        parts.append(f"<tool_call>\n{json.dumps({'name': fn.get('name'), 'arguments': args})}\n</tool_call>")
    return "\n".join(parts)


def _tool_calls(text: str, parse) -> tuple[str | None, list[dict]]:
    """A reply's text as OpenAI's (content, tool_calls): the calls `parse` finds (malformed ones stay
    in the content, where the agent sees them), the text before the first call as the content."""
    calls = [c for c in parse(text) if isinstance(c, dict)]
    if not calls:
        return text, []
    content = text.split("<tool_call>", 1)[0].strip() or None
    out = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
        }
        for c in calls
    ]
    return content, out


ONE_SAMPLE = Sampling(n=1, temperature=1.0, top_p=1.0, max_new_tokens=64)
FIRST_STEP = SeedKey(run_seed=0, step=0)


class AgentServer:
    """The endpoint over `engine` (a `RolloutEngine`) and `codec` (a `ChatCodec` with a chat
    template). `start()` binds 127.0.0.1 on a free port; `base_url` and `api_key` are what a client
    needs. `begin(...)` opens a round of episodes with its sampling and seeds, `take()` hands back
    their records.

    `rounds=True` (partial rollouts): no worker thread; calls wait in the queue until the trainer
    runs `round(cap, version)`, so a step can stop between engine calls while agents wait on their
    calls, and go on after the weight sync. `add(...)` registers episodes without dropping others."""

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
        self.sampling, self.max_model_len = sampling, max_model_len
        self.batch_window_s, self.max_batch = batch_window_s, max_batch
        self.tool_parser = tool_parser  # text -> tool calls (the tool environment's parser); None: no tools
        self._codecs: dict[str, Any] = {"": codec}  # by the request's tools (JSON)
        self._replies: dict[str, str] = {}  # tool call id -> the reply's sampled text (this round)
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.run_seed, self.step = 0, 0
        self.tracks: dict[str, _Track] = {}
        self.engine_calls: list[int] = []  # requests per engine call (how well calls were batched)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a call was queued, or `poke` (an agent ended)
        self._queue: queue.Queue = queue.Queue()
        self.rounds = rounds
        self._held: list[_Job] = []  # rounds mode: calls paused at the last round (its cap, or the stream cut there)
        self._closing = False
        self._server = self._thread = self._worker = None
        self.host, self.port = "127.0.0.1", 0

    # ------------------------------------------------------------------ lifecycle
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> AgentServer:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))  # loopback only: the endpoint serves this machine's agents
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        if not self.rounds:
            self._worker = threading.Thread(target=self._work, name="agent-server-engine", daemon=True)
            self._worker.start()
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
        if self.rounds:
            with self._lock:
                self._closing = True  # no call is queued after this
                jobs = self._take_waiting()
            self._fail(jobs, RunEnded())
        self._server.should_exit = True
        self._thread.join()
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
        self._server = None

    def __enter__(self) -> AgentServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def begin(self, sampling: Sampling, seed: SeedKey, episodes: dict[str, tuple[int, int]]) -> None:
        """A new round sampled as `sampling`: earlier episodes are dropped; `episodes` maps each id to
        (its prompt's global position, its sample index), what its calls' seeds derive from; an
        unknown id gets a position from its hash."""
        with self._lock:
            self.sampling, self.run_seed, self.step = sampling, seed.run_seed, seed.step
            self.tracks = {e: _Track(position=p, sample=j) for e, (p, j) in episodes.items()}
            self.engine_calls, self._replies = [], {}

    def settle(self) -> None:
        """Wait until every call taken has been generated and recorded (an agent cancelled at its
        timeout may leave its last call queued: its row must not change after it is assembled)."""
        while True:
            with self._lock:
                if all(t.pending == 0 for t in self.tracks.values()):
                    return
            time.sleep(0.01)

    def take(self, ids: list[str]) -> dict[str, _Track]:
        """These episodes' records, forgotten here (others stay: rounds mode keeps episodes in
        flight; a round's `begin` drops what is left)."""
        with self._lock:
            tracks = {e: self.tracks.pop(e) for e in ids if e in self.tracks}
            for t in tracks.values():
                for c in t.reply_ids:
                    self._replies.pop(c, None)
        return tracks

    # ------------------------------------------------------------------ rounds mode (partial rollouts)
    def add(self, run_seed: int, episodes: dict[str, tuple[int, int, int]]) -> None:
        """Register episodes, each id -> (its prompt's step, global position, sample): what its
        requests' seeds derive from, whenever they run."""
        with self._lock:
            self.run_seed = run_seed
            for e, (step, position, sample) in episodes.items():
                self.tracks[e] = _Track(position=position, sample=sample, step=step)

    def _waiting(self, ids: list[str]) -> bool:
        """Every one of these episodes has a call queued or paused (its agent waits on the server). Under the lock."""
        return all(self.tracks[e].pending > 0 for e in ids if e in self.tracks)

    def wait_until_waiting(self, live: Callable[[], list[str]], timeout: float) -> bool:
        """Block until every episode `live()` names waits on the server (`_waiting`), woken by each
        call queued and each `poke`, not by polling. -> False at the timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._waiting(live()), timeout)

    def poke(self) -> None:
        """Wake `wait_until_waiting` (an agent ended without a call, so `live()` changed)."""
        with self._changed:
            self._changed.notify_all()

    def settled(self, ids: list[str]) -> bool:
        """None of these episodes has a call left to generate."""
        with self._lock:
            return all(self.tracks[e].pending == 0 for e in ids if e in self.tracks)

    def round(self, cap: int | None, version: int) -> int:
        """Rounds mode: one engine call for every queued call and every call paused at the last
        round's cap, each generating the rest of its budget, or at most `cap` tokens (a call cut at
        the cap stays held and goes on at the next round, from its prompt and the ids sampled so far;
        its tokens keep the `version` that sampled them). Each request's seed: (run seed, its
        episode's step, position and sample, the episode's request count), so a call that is not
        cut draws what the synchronous round draws. -> the call's decode steps (its longest output)."""
        with self._lock:
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
        stream = self.engine.stream(self.sampling.temperature, self.sampling.top_p, chunk)
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
        with self._lock:
            for j in self._take_waiting():
                stream.add([j], j.call.prompt_ids + j.ids, j.budget - len(j.ids), self._request_seed(j))

    def _take_waiting(self) -> list[_Job]:
        """The calls held at the last round, then those queued since. Under the lock."""
        jobs, self._held = self._held + self._drain(), []
        return jobs

    def _request_seed(self, j: _Job) -> int:
        """The seed of `j`'s next engine request (`_seed` over its episode's request count, counted
        here). Under the lock."""
        seed = self._seed(j.track, j.track.requests)
        j.track.requests += 1
        if not j.ids:  # the seed the response reports: its first request's
            j.seed = seed
        return seed

    def _drain(self) -> list[_Job]:
        jobs = []
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return jobs
            if job is not None:
                jobs.append(job)

    def _fail(self, jobs: list[_Job], e: Exception) -> None:
        with self._lock:
            for j in jobs:
                j.track.pending -= 1
        for j in jobs:
            j.future.set_exception(e)

    # ------------------------------------------------------------------ HTTP
    def _app(self):
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        def error(status: int, message: str) -> JSONResponse:
            kind = "authentication_error" if status == 401 else "invalid_request_error"
            return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

        async def serve(request: Request, submit, respond):
            """Both endpoints: the key, the body, `submit(episode, body) -> _Job`, then the answer."""
            auth = request.headers.get("authorization", "")
            if not secrets.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode()):
                return error(401, "a valid `Authorization: Bearer <key>` is required")
            try:
                body = await request.json()
            except ValueError:
                return error(400, "the body is not JSON")
            try:
                if not isinstance(body, dict):
                    raise RequestError(400, "the body must be a JSON object")
                if body.get("stream"):
                    raise RequestError(400, "streaming is not supported")
                episode = request.headers.get(EPISODE_HEADER) or f"anonymous-{uuid.uuid4().hex}"
                job = submit(episode, body)
            except RequestError as e:
                return error(e.status, str(e))
            try:
                await asyncio.wrap_future(job.future)
            except RunEnded:
                return error(503, "the run ended")
            except Exception as e:  # the engine failed: this request fails, the server keeps serving
                log.warning("agent endpoint: generation failed", exc_info=e)
                return error(500, f"generation failed: {type(e).__name__}: {e}")
            return JSONResponse(respond(job, body))

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await serve(request, self._submit_chat, self._response)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await serve(request, self._submit_text, self._text_response)

        return app

    def _submit_chat(self, episode: str, body: dict) -> _Job:
        with self._lock:
            messages = _messages(body.get("messages"), self._replies)
        return self._submit(episode, messages, self._tools(body.get("tools")))

    def _tools(self, tools) -> str:
        """The request's tools as a key of `_codecs` (the codec that renders with them)."""
        if not tools:
            return ""
        if self.tool_parser is None:
            raise RequestError(400, "this endpoint serves no tools")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise RequestError(400, "`tools` must be a list of objects")
        key = json.dumps(tools, sort_keys=True)
        with self._lock:
            if key not in self._codecs:
                try:
                    self._codecs[key] = self.codec.with_tools(tools)
                except ConfigError as e:
                    raise RequestError(400, str(e)) from None
        return key

    def codec_for(self, tools: str) -> Any:
        """The codec that rendered calls made with `tools` (the key `_tools` gave them)."""
        return self._codecs[tools]

    def _response(self, job: _Job, body: dict) -> dict:
        call = job.call
        content, tool_calls = call.messages[-1]["content"], []
        if call.tools and call.finish == "stop":  # a reply cut at its budget has no whole call
            content, tool_calls = _tool_calls(content, self.tool_parser)
            with self._lock:
                self._replies.update({c["id"]: call.messages[-1]["content"] for c in tool_calls})
                job.track.reply_ids += [c["id"] for c in tool_calls]
        message = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else call.finish}
        return self._envelope(job, body, f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", choice)

    def _text_response(self, job: _Job, body: dict) -> dict:
        call = job.call
        choice = {"index": 0, "text": self.codec.action_text(call.ids), "finish_reason": call.finish}
        return self._envelope(job, body, f"cmpl-{uuid.uuid4().hex}", "text_completion", choice)

    def _envelope(self, job: _Job, body: dict, id_: str, kind: str, choice: dict) -> dict:
        """OpenAI's response around `choice`, plus the ids fed and sampled and what the trainer owned."""
        call = job.call
        owned = {
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "max_tokens": job.budget,
            "max_completion_tokens": job.budget,
            "seed": job.seed,
            "n": 1,
        }
        overridden = [k for k in _OWNED if body.get(k) is not None and body[k] != owned[k]]
        return {
            "id": id_,
            "object": kind,
            "created": int(time.time()),
            "model": body.get("model") or "verl-ds-policy",
            "choices": [{**choice, "logprobs": None}],
            "usage": {
                "prompt_tokens": len(call.prompt_ids),
                "completion_tokens": len(call.ids),
                "total_tokens": len(call.prompt_ids) + len(call.ids),
            },
            "prompt_token_ids": call.prompt_ids,
            "generation_token_ids": call.ids,
            "generation_log_probs": call.logprobs,
            "verl_ds": {
                "overridden": overridden,
                "ignored": [k for k in _IGNORED if body.get(k) is not None],
                "sampling": {
                    "temperature": self.sampling.temperature,
                    "top_p": self.sampling.top_p,
                    "max_tokens": job.budget,
                    "seed": job.seed,
                },
                "continues_row": job.continues,
            },
        }

    # ------------------------------------------------------------------ calls -> ids
    def _submit(self, episode: str, messages: list[dict], tools: str = "") -> _Job:
        """Decide the call's ids (continue the episode's row, or fork one) and queue it."""
        with self._lock:
            codec = self._codecs[tools]
            track = self._track(episode)
            prev = track.last if track.pending == 0 else None  # a concurrent call of one episode forks
            prompt, continues = None, False
            if prev is not None and prev.tools == tools:  # other tools: the template's system part differs
                prev_ids = prev.prompt_ids + prev.ids
                n = len(prev.messages)
                if (
                    prev.finish == "stop"
                    and len(messages) > n
                    and messages[:n] == prev.messages
                    and codec.extends(prev.messages, messages)
                ):  # the conversation as the server left it, then new messages: ids, not re-rendered text
                    prompt, continues = prev_ids + codec.observation_ids(messages[n:]), True
                else:
                    rendered = codec.render_ids(messages, add_generation_prompt=True)
                    if len(rendered) > len(prev_ids) and rendered[: len(prev_ids)] == prev_ids:
                        prompt, continues = rendered, True
            if prompt is None:
                prompt = codec.render_ids(messages, add_generation_prompt=True)
            job = self._job(track, _Call(prompt, list(messages), tools), continues)
        self._queue.put(job)
        return job

    def _submit_text(self, episode: str, body: dict) -> _Job:
        """A `/v1/completions` call: its prompt (one text, or one list of token ids) continues the
        episode's row when it starts with the previous call's prompt and completion (as text: the
        ids sampled are kept, only the new text is tokenized; as ids: a prefix), else it forks."""
        text, ids = _text_prompt(body.get("prompt"))
        with self._lock:
            track = self._track(episode)
            prev = track.last if track.pending == 0 else None
            prompt, continues = None, False
            if prev is not None and prev.tools is None:  # a reply cut at its budget continues as text too
                prev_ids = prev.prompt_ids + prev.ids
                if text is not None and text.startswith(prev.text) and len(text) > len(prev.text):
                    prompt, continues = prev_ids + self.codec.content_ids(text[len(prev.text) :]), True
                else:
                    whole = ids if ids is not None else self.codec.content_ids(text)
                    if len(whole) > len(prev_ids) and whole[: len(prev_ids)] == prev_ids:
                        prompt, continues = whole, True
            if prompt is None:
                prompt = ids if ids is not None else self.codec.content_ids(text)
            if not prompt:
                raise RequestError(400, "`prompt` is empty")
            if max(prompt) >= len(self.codec.tok):
                raise RequestError(400, f"token id {max(prompt)} is not in the vocabulary ({len(self.codec.tok)})")
            call = _Call(prompt, [], None, text if text is not None else self.codec.decode(prompt))
            job = self._job(track, call, continues)
        self._queue.put(job)
        return job

    def _track(self, episode: str) -> _Track:
        track = self.tracks.get(episode)
        if track is None:  # an episode the round did not announce: seeds from its id
            track = self.tracks[episode] = _Track(position=(1 << 31) + zlib.crc32(episode.encode()), sample=0)
        return track

    def _job(self, track: _Track, call: _Call, continues: bool) -> _Job:
        """The call's budget (what is left under max_model_len) and seed; counted as pending. Under the lock."""
        if self._closing:
            raise RequestError(503, "the run is ending")
        budget = min(self.sampling.max_new_tokens, self.max_model_len - len(call.prompt_ids))
        if budget < 1:
            raise RequestError(
                400,
                f"the prompt is {len(call.prompt_ids)} tokens: no room left under max_model_len {self.max_model_len}",
            )
        seed = self._seed(track, track.calls)
        track.calls += 1
        track.pending += 1
        self._changed.notify_all()
        return _Job(track, call, seed, budget, concurrent.futures.Future(), continues)

    def _seed(self, track: _Track, turn: int) -> int:
        """A request's seed: (run seed, its episode's step, position and sample, `turn`). Under the lock."""
        step = self.step if track.step is None else track.step
        return turn_seed(self.run_seed, step, track.position, track.sample, turn)

    def _work(self) -> None:
        """The engine's one thread: take what is queued (waiting `batch_window_s` for more), one
        engine call for all of it."""
        while True:
            first = self._queue.get()
            if first is None:
                return
            jobs, stop = [first], False
            deadline = time.monotonic() + self.batch_window_s
            while len(jobs) < self.max_batch:
                try:
                    job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                    break
                jobs.append(job)
            self._generate(jobs, [j.seed for j in jobs], None, self.step)
            if stop:
                return

    def _generate(self, jobs: list[_Job], seeds: list[int], cap: int | None, version: int) -> int:
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
        with self._lock:
            for j, ids, lps, reason, paused in results:
                j.ids, j.logprobs, j.versions = j.ids + ids, j.logprobs + lps, j.versions + [version] * len(ids)
                if paused:
                    self._held.append(j)
                    continue
                self._record(j, j.ids, j.logprobs, reason)
                j.track.versions += j.versions
                done.append(j)
        for j in done:
            j.future.set_result(None)

    def _record(self, job: _Job, ids: list[int], lps: list[float], reason: str) -> None:
        call, track = job.call, job.track
        call.ids, call.logprobs, call.finish = list(ids), list(lps), reason
        if call.tools is None:  # a completions call: the text the client gets back continues it
            call.text += self.codec.action_text(ids)
        else:
            call.messages.append({"role": "assistant", "content": self.codec.action_text(ids)})
        if job.continues and track.segments:
            seg = track.segments[-1]
            seg.add(call.prompt_ids[len(seg.prompt_ids) + len(seg.ids) :], model=False)
            track.segment_finish[-1] = reason
        else:
            seg = Segment(list(call.prompt_ids), [])
            track.segments.append(seg)
            track.segment_tools.append(call.tools)
            track.segment_finish.append(reason)
        seg.add(call.ids, model=True, logprobs=call.logprobs)
        seg.messages = list(call.messages)
        track.last, track.last_action = call, call.ids
        track.pending -= 1


# ---------------------------------------------------------------------------- the runner


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
) -> _Played:
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
    await asyncio.to_thread(server.settle)  # calls of agents cancelled at their timeout may still be queued
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

    def _round(self, examples, positions, sampling, seed, engine) -> _Played:
        if self.server is None:
            self.server = AgentServer(
                engine, self.codec, sampling, self.max_model_len, tool_parser=self.tool_parser
            ).start()
        return asyncio.run(_play(self.agent_fn, examples, self.server, sampling, seed, self.timeout_s, positions))

    def _play_as_group(self, examples, positions, sampling, seed) -> _Played:
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
class _Played:
    """A round of agent episodes, before they become rows: per episode its rows' strict checks."""

    episodes: list[Episode]
    exact: list[list[bool]]  # per episode, per row: equal to the one-shot rendering (`_one_shot`)
    engine_calls: list[int]  # requests per engine call

    def split(self, sizes: list[int]) -> list[_Played]:
        """Per consecutive run of `sizes` examples, its episodes (groups renumbered from 0)."""
        out, start = [], 0
        for size in sizes:
            keep = [k for k, ep in enumerate(self.episodes) if start <= ep.group < start + size]
            eps = [replace(self.episodes[k], group=self.episodes[k].group - start) for k in keep]
            out.append(_Played(eps, [self.exact[k] for k in keep], self.engine_calls))
            start += size
        return out


def played_episodes(server: AgentServer, ids: list[str], results: list[tuple[float, str]], n: int) -> _Played:
    calls_per_engine_call = list(server.engine_calls)
    tracks = server.take(ids)
    episodes = []
    for k, (eid, (reward, failure)) in enumerate(zip(ids, results)):
        t = tracks.get(eid) or _Track(position=k // n, sample=k % n)
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
        [_one_shot(server, t.segment_tools[k], seg, t.segment_finish[k]) for k, seg in enumerate(t.segments)]
        for t in (tracks.get(eid) or _Track(0, 0) for eid in ids)
    ]
    return _Played(episodes, exact, calls_per_engine_call)


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


def played_rollout(played: _Played, codec, pad_id: int, max_failure_fraction: float = 1.0) -> Rollout:
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


def _one_shot(server: AgentServer, tools: str | None, seg: Segment, finish: str) -> bool:
    """The strict check of one row: its ids equal the one-shot rendering of its conversation (a text
    row: the tokenizer over its whole text)."""
    if tools is None:
        ours = seg.prompt_ids + seg.ids
        return server.codec.content_ids(server.codec.decode(ours)) == ours
    return server.codec_for(tools).matches_one_shot(seg.prompt_ids, seg.messages, seg.ids, cut=finish == "length")


__all__ = ["AgentEpisodes", "AgentServer", "run_agents", "arun_agents", "check_agent", "EPISODE_HEADER"]
