"""OpenAI's request shapes as the agent endpoint reads them: a request's messages, its tools' calls
and a completions prompt, checked where they enter (a request the endpoint cannot serve is a
`RequestError`: its status and message go back to the client, nothing is raised out)."""

from __future__ import annotations

import json
import uuid

EPISODE_HEADER = "X-Episode-Id"
# client parameters the trainer owns: its value is used, the client's (when it differs) reported
OWNED = ("temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "n")
# accepted and not applied yet (reported in `verl_ds.ignored`)
IGNORED = ("stop", "tool_choice", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty")


class RunEnded(Exception):
    """A call still waiting when the endpoint stops (rounds mode): it fails, quietly."""


class RequestError(Exception):
    """A request the server cannot serve: answered with `status` and the message, never raised out."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def text(content) -> str:
    """A message's content as text: a string, or OpenAI's list of parts (text parts only)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(400, "only text message content is supported")


def text_prompt(raw) -> tuple[str | None, list[int] | None]:
    """A completions request's `prompt` as (text, None) or (None, token ids): one prompt per request
    (the episode's next turn), given as a string or a list of ids (or a list holding one of them)."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]
    if isinstance(raw, str):
        return raw, None
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw):
        return None, list(raw)
    raise RequestError(400, "`prompt` must be one string or one list of token ids (one prompt per request)")


def messages(raw, replies: dict[str, str]) -> list[dict]:
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
            out.append({"role": m["role"], "content": text(m.get("content"))})
    return out


def _tool_call_text(message: dict, calls, replies: dict[str, str]) -> str:
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise RequestError(400, "`tool_calls` must be a list of objects")
    sent = {replies.get(str(c.get("id"))) for c in calls}
    if len(sent) == 1 and None not in sent:  # the reply as sampled: its ids continue the row
        return sent.pop()
    parts = [text(message.get("content"))] if message.get("content") else []
    for c in calls:
        fn = c.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            raise RequestError(400, "a tool call's `arguments` must be a JSON string") from None
        parts.append(f"<tool_call>\n{json.dumps({'name': fn.get('name'), 'arguments': args})}\n</tool_call>")
    return "\n".join(parts)


def tool_calls(reply: str, parse) -> tuple[str | None, list[dict]]:
    """A reply's text as OpenAI's (content, tool_calls): the calls `parse` finds (malformed ones stay
    in the content, where the agent sees them), the text before the first call as the content."""
    calls = [c for c in parse(reply) if isinstance(c, dict)]
    if not calls:
        return reply, []
    content = reply.split("<tool_call>", 1)[0].strip() or None
    out = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
        }
        for c in calls
    ]
    return content, out
