"""Agent calls as token-exact rows, as the environment path (`episodes/loop.py`) builds them.

A call whose conversation continues the episode's previous call (its messages, then the assistant
reply the server sent, then new messages) is fed the previous call's ids + the reply's sampled ids +
the new messages' ids (`ChatCodec.observation_ids`), so the model's tokens are never re-tokenized
from text; the ids in between are environment tokens (loss mask 0), the completion is the model's
(mask 1, its rollout logprobs). A call whose one-shot rendering extends the previous call's ids as
ids also continues. Any other call (the agent edited or dropped history, or a concurrent call of the
same episode) starts a new row: a fork.

`Recorder` holds every episode's `Track`; it takes no lock of its own: the server's lock is held
around each of its methods (the HTTP handlers and the engine's thread both reach it).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from verl_ds.errors import ConfigError

from ..episodes import Segment
from ..seeding import turn_seed
from .protocol import RequestError


@dataclass
class Call:
    prompt_ids: list[int]
    messages: list[dict]  # the request's conversation, the assistant reply appended once generated
    tools: str | None = ""  # the request's tools (JSON), a row continues only under the same; None: a
    # `/v1/completions` call (a text prompt, `messages` empty)
    text: str = ""  # a completions call: its prompt text, then its reply's text appended
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = "stop"


@dataclass
class Track:
    """One episode's calls and the rows they built."""

    position: int  # seeds: its prompt's global position in the step (`prompt_positions`)
    sample: int  # seeds: 0 .. n-1 among its prompt's episodes
    step: int | None = None  # seeds: the step its prompt was drawn at (None: the server's round)
    segments: list[Segment] = field(default_factory=list)
    last: Call | None = None  # the previous finished call, what the next may continue
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


class Recorder:
    """Every episode's calls -> its rows, over `codec` (a `ChatCodec` with a chat template) and the
    codecs it derives per request's tools; `tool_parser`: a reply's text -> its tool calls (None: the
    endpoint serves no tools)."""

    def __init__(self, codec, tool_parser: Callable[[str], list] | None = None):
        self.codec, self.tool_parser = codec, tool_parser
        self.codecs: dict[str, Any] = {"": codec}  # by the request's tools (JSON)
        self.replies: dict[str, str] = {}  # tool call id -> the reply's sampled text (this round)
        self.tracks: dict[str, Track] = {}
        self.run_seed, self.step = 0, 0

    # ------------------------------------------------------------------ episodes
    def begin(self, run_seed: int, step: int, episodes: dict[str, tuple[int, int]]) -> None:
        """A new round: earlier episodes are dropped; each id -> (its prompt's position, its sample)."""
        self.run_seed, self.step = run_seed, step
        self.tracks = {e: Track(position=p, sample=j) for e, (p, j) in episodes.items()}
        self.replies = {}

    def add(self, run_seed: int, episodes: dict[str, tuple[int, int, int]]) -> None:
        """Register episodes, each id -> (its prompt's step, position, sample), keeping the others."""
        self.run_seed = run_seed
        for e, (step, position, sample) in episodes.items():
            self.tracks[e] = Track(position=position, sample=sample, step=step)

    def take(self, ids: list[str]) -> dict[str, Track]:
        """These episodes' records, forgotten here."""
        tracks = {e: self.tracks.pop(e) for e in ids if e in self.tracks}
        for t in tracks.values():
            for c in t.reply_ids:
                self.replies.pop(c, None)
        return tracks

    def track(self, episode: str) -> Track:
        track = self.tracks.get(episode)
        if track is None:  # an episode the round did not announce: seeds from its id
            track = self.tracks[episode] = Track(position=(1 << 31) + zlib.crc32(episode.encode()), sample=0)
        return track

    def seed(self, track: Track, turn: int) -> int:
        """A request's seed: (run seed, its episode's step, position and sample, `turn`)."""
        step = self.step if track.step is None else track.step
        return turn_seed(self.run_seed, step, track.position, track.sample, turn)

    # ------------------------------------------------------------------ calls -> ids
    def tools_key(self, tools) -> str:
        """The request's tools as a key of `codecs` (the codec that renders with them)."""
        if not tools:
            return ""
        if self.tool_parser is None:
            raise RequestError(400, "this endpoint serves no tools")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise RequestError(400, "`tools` must be a list of objects")
        key = json.dumps(tools, sort_keys=True)
        if key not in self.codecs:
            try:
                self.codecs[key] = self.codec.with_tools(tools)
            except ConfigError as e:
                raise RequestError(400, str(e)) from None
        return key

    def chat_call(self, episode: str, messages: list[dict], tools: str) -> tuple[Track, Call, bool]:
        """A chat call's ids: (its track, the call, whether it continues the episode's last row)."""
        codec = self.codecs[tools]
        track = self.track(episode)
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
        return track, Call(prompt, list(messages), tools), continues

    def text_call(self, episode: str, text: str | None, ids: list[int] | None) -> tuple[Track, Call, bool]:
        """A `/v1/completions` call: its prompt (one text, or one list of token ids) continues the
        episode's row when it starts with the previous call's prompt and completion (as text: the
        ids sampled are kept, only the new text is tokenized; as ids: a prefix), else it forks."""
        codec = self.codec
        track = self.track(episode)
        prev = track.last if track.pending == 0 else None
        prompt, continues = None, False
        if prev is not None and prev.tools is None:  # a reply cut at its budget continues as text too
            prev_ids = prev.prompt_ids + prev.ids
            if text is not None and text.startswith(prev.text) and len(text) > len(prev.text):
                prompt, continues = prev_ids + codec.content_ids(text[len(prev.text) :]), True
            else:
                whole = ids if ids is not None else codec.content_ids(text)
                if len(whole) > len(prev_ids) and whole[: len(prev_ids)] == prev_ids:
                    prompt, continues = whole, True
        if prompt is None:
            prompt = ids if ids is not None else codec.content_ids(text)
        if not prompt:
            raise RequestError(400, "`prompt` is empty")
        if max(prompt) >= len(codec.tok):
            raise RequestError(400, f"token id {max(prompt)} is not in the vocabulary ({len(codec.tok)})")
        return track, Call(prompt, [], None, text if text is not None else codec.decode(prompt)), continues

    # ------------------------------------------------------------------ ids -> rows
    def record(self, track: Track, call: Call, continues: bool, ids: list[int], lps: list[float], reason: str) -> None:
        """A call's completion: appended to the episode's last row (`continues`) or a new one."""
        call.ids, call.logprobs, call.finish = list(ids), list(lps), reason
        if call.tools is None:  # a completions call: the text the client gets back continues it
            call.text += self.codec.action_text(ids)
        else:
            call.messages.append({"role": "assistant", "content": self.codec.action_text(ids)})
        if continues and track.segments:
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

    def remember_replies(self, track: Track, reply: str, call_ids: list[str]) -> None:
        """The reply's text by its tool call ids: an agent that sends the calls back continues the row."""
        self.replies.update({c: reply for c in call_ids})
        track.reply_ids += call_ids

    def one_shot(self, tools: str | None, seg: Segment, finish: str) -> bool:
        """The strict check of one row: its ids equal the one-shot rendering of its conversation (a text
        row: the tokenizer over its whole text)."""
        if tools is None:
            ours = seg.prompt_ids + seg.ids
            return self.codec.content_ids(self.codec.decode(ours)) == ours
        return self.codecs[tools].matches_one_shot(seg.prompt_ids, seg.messages, seg.ids, cut=finish == "length")
