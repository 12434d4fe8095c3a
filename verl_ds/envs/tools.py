"""Tools: plain Python functions the model calls with hermes `<tool_call>{...}</tool_call>` text.

`ToolEnv` parses the calls in an action (never executes the text itself), runs each named tool
with a timeout, answers with one `tool` message per call, and ends the episode on an action
without a call. A tool that raises or times out answers `error: ...` (counted in `info`), and a
malformed call answers the same way: the model learns from it, the run never crashes on it.
Schemas come from the functions' type hints and docstrings (`transformers.utils.get_json_schema`).
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import operator
import re
from typing import Callable

from verl_ds.envs.base import import_object
from verl_ds.errors import ConfigError

BUILTIN_TOOLS = {"calculator": "verl_ds.envs.tools:calculator"}

_BIN = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _arith(node) -> float | int:
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_arith(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        left, right = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("exponent too large")  # 9**9**9 would run for ever
        return _BIN[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(12 + 7) * 3".
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _arith(ast.parse(expression.strip(), mode="eval"))  # a parse tree walk, not eval()
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


def load_tools(specs: list[str], key: str = "data.tools") -> list[Callable]:
    """`data.tools`: built-in names (`calculator`) or `pkg.module:function` paths; each must give a
    JSON schema (type hints + a docstring with an Args section)."""

    tools = []
    for i, spec in enumerate(specs):
        fn = import_object(BUILTIN_TOOLS.get(spec, spec), f"{key}[{i}]")
        if not callable(fn):
            raise ConfigError(f"{key}[{i}]", f"'{spec}' is not a function")
        tool_schemas([fn], f"{key}[{i}]")
        tools.append(fn)
    names = [t.__name__ for t in tools]
    if len(set(names)) != len(names):
        raise ConfigError(key, f"two tools share a name: {names}")
    return tools


def tool_schemas(tools: list[Callable], key: str = "data.tools") -> list[dict]:
    from transformers.utils import get_json_schema

    out = []
    for fn in tools:
        try:
            out.append(get_json_schema(fn))
        except Exception as e:  # transformers raises its own DocstringParsingException / TypeHintParsingException
            raise ConfigError(
                key,
                f"{getattr(fn, '__name__', fn)}: no JSON schema ({e}); give it type hints "
                "and a docstring with an Args section",
            ) from None
    return out


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes_tool_calls(text: str) -> list[dict | str]:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in `text`: a dict per call,
    or an error string for one that is not such JSON. An unclosed `<tool_call>` counts as a call."""
    bodies = _CALL.findall(text)
    tail = text.rsplit("</tool_call>", 1)[-1]
    if "<tool_call>" in tail:
        bodies.append(tail.split("<tool_call>", 1)[1])
    calls: list[dict | str] = []
    for body in bodies:
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as e:
            calls.append(f"error: the tool call is not valid JSON ({e.msg})")
            continue
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("name"), str)
            or not isinstance(call.get("arguments", {}), dict)
        ):
            calls.append('error: a tool call must be {"name": "...", "arguments": {...}}')
            continue
        calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    return calls


PARSERS = {"hermes": parse_hermes_tool_calls}


class ToolEnv:
    """The built-in tool environment (`rollout.multi_turn.env: tools`). Reward comes from the task's
    reward function on the final answer (the action without a tool call)."""

    def __init__(self, tools: list[Callable], parser: str = "hermes", timeout_s: float = 5.0):
        if parser not in PARSERS:
            raise ConfigError("rollout.multi_turn.env_kwargs.parser", f"'{parser}' is not one of {', '.join(PARSERS)}")
        self.tools = {t.__name__: t for t in tools}
        self.parse, self.timeout_s = PARSERS[parser], timeout_s

    def reset(self, example: dict):
        return None

    def step(self, action: str):
        calls = self.parse(action)
        if not calls:
            return None, 0.0, True, {"tool_calls": 0.0, "tool_failures": 0.0}
        results = [self._run(c) for c in calls]
        failures = sum(r.startswith("error:") for r in results)
        return (
            [{"role": "tool", "content": r} for r in results],
            0.0,
            False,
            {"tool_calls": float(len(calls)), "tool_failures": float(failures)},
        )

    def _run(self, call: dict | str) -> str:
        if isinstance(call, str):
            return call
        fn = self.tools.get(call["name"])
        if fn is None:
            return f"error: no tool named {call['name']!r} (tools: {', '.join(self.tools)})"
        # a thread, so a slow tool is abandoned after timeout_s (Python cannot kill it; it finishes alone)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            return str(pool.submit(fn, **call["arguments"]).result(timeout=self.timeout_s))
        except concurrent.futures.TimeoutError:
            return f"error: {call['name']} timed out after {self.timeout_s:g} s"
        except Exception as e:  # the tool's own failure is the model's feedback
            return f"error: {type(e).__name__}: {e}"
        finally:
            pool.shutdown(wait=False)
