"""The tool environment and the environment loader: parse, never execute; failures are answers."""

import time

import pytest

from verl_ds.envs import ToolEnv, calculator, load_env_factory, load_tools, parse_hermes_tool_calls, tool_schemas
from verl_ds.errors import ConfigError


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "late"


def broken(x: int) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("boom")


def undocumented(x):
    return x


class NoStep:
    def reset(self, example):
        return None


class BadStep:
    def reset(self, example):
        return None

    def step(self):
        return None, 0.0, True, {}


def test_calculator_walks_the_parse_tree_and_refuses_code():
    assert calculator("(12 + 7) * 3") == "57" and calculator("7 / 2") == "3.5" and calculator("-2 ** 3") == "-8"
    for bad in ("__import__('os').system('true')", "open('x')", "[1, 2]", "a + 1", "9 ** 9 ** 9"):
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)


def test_hermes_parser_reads_calls_and_reports_malformed_ones():
    text = (
        'think <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call> and '
        '<tool_call>{not json}</tool_call> <tool_call>["x"]</tool_call> <tool_call>{"name": "f"'
    )
    calls = parse_hermes_tool_calls(text)
    assert calls[0] == {"name": "calculator", "arguments": {"expression": "1+1"}}
    assert [c.split(" (")[0] for c in calls[1:]] == [
        "error: the tool call is not valid JSON",
        'error: a tool call must be {"name": "...", "arguments": {...}}',
        "error: the tool call is not valid JSON",
    ]
    assert parse_hermes_tool_calls("The answer is 4.") == []


def test_tool_env_answers_every_call_and_counts_failures():
    env = ToolEnv([calculator, slow, broken], timeout_s=0.2)
    assert env.reset({"prompt": "p", "answer": "1"}) is None
    call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'.format
    action = (
        call("calculator", '{"expression": "6*7"}')
        + call("slow", '{"seconds": 2}')
        + call("broken", '{"x": 1}')
        + call("nope", "{}")
        + call("calculator", '{"expression": "import os"}')
        + "<tool_call>{bad"
    )
    t0 = time.perf_counter()
    obs, reward, done, info = env.step(action)
    assert time.perf_counter() - t0 < 1.5  # the slow tool was abandoned at 0.2 s
    assert not done and reward == 0.0 and [m["role"] for m in obs] == ["tool"] * 6
    results = [m["content"] for m in obs]
    assert results[0] == "42"
    assert results[1] == "error: slow timed out after 0.2 s"
    assert results[2] == "error: RuntimeError: boom"
    assert results[3].startswith("error: no tool named 'nope'")
    assert results[4].startswith("error: SyntaxError") and results[5].startswith("error: the tool call is not valid")
    assert info == {"tool_calls": 6.0, "tool_failures": 5.0}
    assert env.step("The answer is 42.") == (None, 0.0, True, {"tool_calls": 0.0, "tool_failures": 0.0})


def test_tools_and_envs_load_from_config_paths_with_one_line_errors():
    tools = load_tools(["calculator", "tests.envs.test_tools:slow"])
    assert [t.__name__ for t in tools] == ["calculator", "slow"]
    assert tool_schemas([calculator])[0]["function"]["parameters"]["required"] == ["expression"]
    env = load_env_factory("tools", {"timeout_s": 1.0}, tools)()
    assert isinstance(env, ToolEnv) and set(env.tools) == {"calculator", "slow"}
    cases = [
        (lambda: load_tools(["tests.envs.test_tools:undocumented"]), "data.tools[0]", "no JSON schema"),
        (lambda: load_tools(["no_such_pkg.mod:f"]), "data.tools[0]", "cannot import module"),
        (lambda: load_env_factory("tests.envs.test_tools:Missing", {}), "rollout.multi_turn.env", "has no 'Missing'"),
        (lambda: load_env_factory("tests.envs.test_tools:NoStep", {}), "rollout.multi_turn.env", "no method step()"),
        (
            lambda: load_env_factory("tests.envs.test_tools:BadStep", {}),
            "rollout.multi_turn.env",
            "must take 1 argument",
        ),
        (lambda: load_env_factory("retry", {"tries": 3}), "rollout.multi_turn.env_kwargs", "tries"),
        (lambda: load_env_factory("nodots", {}), "rollout.multi_turn.env", "not a 'pkg.module:Name' path"),
    ]
    for make, key, text in cases:
        with pytest.raises(ConfigError) as e:
            make()
        assert e.value.where == key and text in str(e.value), (key, str(e.value))


def test_the_documented_example_environment_plays_by_the_contract():
    env = load_env_factory("examples.envs.guess_number:GuessNumber", {"max_guesses": 3})()
    assert env.reset({"prompt": "guess", "answer": "7"}) is None
    assert env.step("I think 3") == ("higher", 0.0, False, {"valid": 1.0})
    assert env.step("nine?") == ("Answer with a number.", 0.0, False, {"valid": 0.0})
    assert env.step("9") == (None, 0.0, True, {"valid": 1.0})  # the third guess: out of guesses
    env.reset({"answer": "7"})
    assert env.step("10")[0] == "lower" and env.step("7") == (None, 0.8, True, {"valid": 1.0})
