"""The endpoint's HTTP surface: `/v1/chat/completions` and `/v1/completions` as OpenAI serves them.

Every request carries the run's secret as `Authorization: Bearer <key>` and names its episode in
the `X-Episode-Id` header. The answer is OpenAI's shape plus the ids the call fed and sampled
(`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`) and what the trainer owned
(`verl_ds.overridden`: the client's differing sampling values; `verl_ds.ignored`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from typing import Callable

from fastapi import FastAPI, Request  # module level: FastAPI resolves the handler's annotations here
from fastapi.responses import JSONResponse

from ..episodes import Sampling
from .protocol import EPISODE_HEADER, IGNORED, OWNED, RequestError, RunEnded
from .scheduler import Job

log = logging.getLogger(__name__)

Submit = Callable[[str, dict], Job]  # (episode id, request body) -> the queued call
Respond = Callable[[Job, dict], dict]  # (the generated call, request body) -> the response body


def make_app(api_key: str, routes: dict[str, tuple[Submit, Respond]]) -> FastAPI:
    """The FastAPI app: each path's `submit` queues the call, `respond` answers it once generated."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str) -> JSONResponse:
        kind = "authentication_error" if status == 401 else "invalid_request_error"
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    async def serve(request: Request, submit: Submit, respond: Respond):
        """Every endpoint: the key, the body, `submit(episode, body) -> Job`, then the answer."""
        auth = request.headers.get("authorization", "")
        if not secrets.compare_digest(auth.encode(), f"Bearer {api_key}".encode()):
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

    def route(submit: Submit, respond: Respond):
        async def handler(request: Request):
            return await serve(request, submit, respond)

        return handler

    for path, (submit, respond) in routes.items():
        app.post(path)(route(submit, respond))
    return app


def chat_response(job: Job, body: dict, sampling: Sampling, content: str | None, tool_calls: list[dict]) -> dict:
    """A chat completion: the reply's `content` and the `tool_calls` parsed from it."""
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else job.call.finish}
    return envelope(job, body, sampling, f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", choice)


def text_response(job: Job, body: dict, sampling: Sampling, reply: str) -> dict:
    """A text completion: the reply's text."""
    choice = {"index": 0, "text": reply, "finish_reason": job.call.finish}
    return envelope(job, body, sampling, f"cmpl-{uuid.uuid4().hex}", "text_completion", choice)


def envelope(job: Job, body: dict, sampling: Sampling, id_: str, kind: str, choice: dict) -> dict:
    """OpenAI's response around `choice`, plus the ids fed and sampled and what the trainer owned."""
    call = job.call
    owned = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": job.budget,
        "max_completion_tokens": job.budget,
        "seed": job.seed,
        "n": 1,
    }
    overridden = [k for k in OWNED if body.get(k) is not None and body[k] != owned[k]]
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
            "ignored": [k for k in IGNORED if body.get(k) is not None],
            "sampling": {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "max_tokens": job.budget,
                "seed": job.seed,
            },
            "continues_row": job.continues,
        },
    }
