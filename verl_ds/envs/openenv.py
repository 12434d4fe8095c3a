"""`rollout.multi_turn.env: openenv`: an OpenEnv environment as it is (PyPI `openenv-core`).

Two ways to reach one (`rollout.multi_turn.env_kwargs`):
- `serve: pkg.module:EnvClass` with `action: pkg.module:ActionClass` and `observation:
  pkg.module:ObservationClass`: this rank serves the class with OpenEnv's own server
  (`create_fastapi_app`, under uvicorn in a background thread) on 127.0.0.1, once per process;
- `base_url: http://127.0.0.1:8000`: an OpenEnv server that already runs (its docker image, say).

Each episode is one OpenEnv session: OpenEnv's own `GenericEnvClient` over the server's
WebSocket, `reset(seed=...)` (the row's `seed` key when it has one, else a hash of its prompt), then
one `step` per model turn. The model's text is the action's `action_field` (default `message`); the
observation's `observation_field` (default `text`) is the next user message; each step's reward is
OpenEnv's own (the loop sums them). Every session's client runs on one event loop thread per
process; a session ends at `done`, or when its episode is dropped.

OpenEnv's server has no key: it is bound to 127.0.0.1 only, and a `base_url` elsewhere is refused.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import weakref
from urllib.parse import urlparse

from verl_ds.errors import ConfigError

from .base import example_seed, import_object

KEY = "rollout.multi_turn.env_kwargs"
_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None  # every session's client, this process
_served: dict[tuple, str] = {}  # (serve, action, observation) -> base_url
_servers: list = []  # the uvicorn servers (kept alive for the process)


def _run(coro, timeout_s: float):
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="openenv-clients", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coro, _loop).result(timeout_s)


def _openenv():
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # its web UI is never built here
    try:
        from openenv.core import GenericEnvClient
        from openenv.core.env_server.http_server import create_fastapi_app
        from openenv.core.env_server.interfaces import Environment
        from openenv.core.env_server.types import Action, Observation
    except ImportError:
        raise ConfigError(
            "rollout.multi_turn.env", "openenv-core is not installed: pip install 'verl-ds[envs]'"
        ) from None
    return GenericEnvClient, create_fastapi_app, Environment, Action, Observation


def _classes(serve: str, action: str, observation: str):
    _, _, Environment, Action, Observation = _openenv()
    out = []
    wanted = (serve, "serve", Environment), (action, "action", Action), (observation, "observation", Observation)
    for spec, key, base in wanted:
        if not spec:
            raise ConfigError(f"{KEY}.{key}", f"serving an OpenEnv environment needs its {key} class too")
        cls = import_object(spec, f"{KEY}.{key}")
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(f"{KEY}.{key}", f"'{spec}' is not an OpenEnv {base.__name__} class")
        out.append(cls)
    if not getattr(out[0], "SUPPORTS_CONCURRENT_SESSIONS", False):
        raise ConfigError(
            f"{KEY}.serve",
            f"{out[0].__name__} does not declare SUPPORTS_CONCURRENT_SESSIONS = True: a step's episodes are "
            "concurrent sessions",
        )
    return out


def _serve(serve: str, action: str, observation: str, max_sessions: int) -> str:
    with _lock:
        url = _served.get((serve, action, observation))
    if url:
        return url
    import uvicorn

    env_cls, action_cls, obs_cls = _classes(serve, action, observation)
    app = _openenv()[1](env_cls, action_cls, obs_cls, max_concurrent_envs=max_sessions)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # loopback only: OpenEnv's server takes no key
    # ws="websockets": with uvicorn's sans-io implementation OpenEnv's close after a client's
    # close raises in the server (a traceback per finished session)
    config = uvicorn.Config(app, log_level="warning", ws="websockets", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="openenv-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"OpenEnv's server for {serve} did not start")
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with _lock:
        _served[(serve, action, observation)] = url
        _servers.append(server)
    return url


def _close(client, timeout_s: float) -> None:
    try:
        _run(client.close(), timeout_s)
    except Exception:  # the session is gone either way
        pass


class OpenEnvEnv:
    def __init__(
        self,
        serve: str = "",
        action: str = "",
        observation: str = "",
        base_url: str = "",
        action_field: str = "message",
        observation_field: str = "text",
        max_sessions: int = 1024,
        timeout_s: float = 60.0,
    ):
        # checked once at start (`load_env_factory` calls check_kwargs), not per episode
        self.base_url = base_url or _serve(serve, action, observation, max_sessions)
        self.action_field, self.observation_field, self.timeout_s = action_field, observation_field, timeout_s
        self.client = None
        self._closer = None

    @staticmethod
    def check_kwargs(serve: str = "", action: str = "", observation: str = "", base_url: str = "", **_) -> None:
        """At start (`load_env_factory`): one way to reach the environment; served classes import and
        are OpenEnv's; a server elsewhere than this machine is refused (OpenEnv's server takes no key),
        and one that does not answer is named now rather than at the first episode."""
        if bool(serve) == bool(base_url):
            raise ConfigError(KEY, "give an OpenEnv environment as serve: pkg.module:EnvClass or base_url: http://...")
        if serve:
            _classes(serve, action, observation)
            return
        url = urlparse(base_url)
        if url.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ConfigError(f"{KEY}.base_url", f"{base_url}: OpenEnv's server takes no key, so only loopback")
        try:
            socket.create_connection((url.hostname, url.port or 80), timeout=5).close()
        except OSError as e:
            raise ConfigError(
                f"{KEY}.base_url", f"{base_url}: nothing answers there ({e.strerror or e}); start the server first"
            ) from None

    def reset(self, example: dict) -> str:
        self._end()
        seed = example_seed(example)
        self.client = _openenv()[0](base_url=self.base_url, message_timeout_s=self.timeout_s)
        self._closer = weakref.finalize(self, _close, self.client, self.timeout_s)
        _run(self.client.connect(), self.timeout_s)
        return self._text(_run(self.client.reset(seed=seed), self.timeout_s))

    def step(self, action: str):
        r = _run(self.client.step({self.action_field: action}), self.timeout_s)
        if r.done:
            self._end()
            return None, float(r.reward or 0.0), True, {}
        return self._text(r), float(r.reward or 0.0), False, {}

    def _text(self, result) -> str:
        obs = result.observation or {}
        if self.observation_field not in obs:
            raise KeyError(f"the observation has no '{self.observation_field}' field (fields: {sorted(obs)})")
        return str(obs[self.observation_field])

    def _end(self) -> None:
        if self._closer is not None:
            self._closer()  # closes the session once
            self._closer = self.client = None
