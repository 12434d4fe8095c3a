"""Agents for the launcher runs, written as users write them: the real `openai.AsyncOpenAI` client,
no verl-ds import. Reached by the ranks through `rollout.multi_turn.agent: tests.e2e.agents:...`."""

from __future__ import annotations

import json

import openai

# small: the tiny model's context is 256 characters, and the template writes the schema into it
CALCULATOR = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


class AgentBroke(RuntimeError):
    pass


async def three_calls(client: openai.AsyncOpenAI, example: dict) -> float:
    """Three calls, each offering a tool: the question; a follow-up (a tool call in the reply is
    answered with its result as a `tool` message); a last turn. Some episodes edit history before the last
    call (a fork) and some raise (counted, reward 0), both chosen by the first sampled token so the
    run is reproducible. Reward: the last reply's length (varied, so advantages are not zero)."""
    messages = [{"role": "user", "content": example["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
    token = first.model_extra["generation_token_ids"][0]
    if token % 7 == 0:
        raise AgentBroke(f"this agent gives up on token {token}")
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "tool?"},
    ]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
    msg = second.choices[0].message
    if msg.tool_calls:
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            result = str(int(args.get("a", 0)) + int(args.get("b", 0)))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    else:
        messages += [{"role": "assistant", "content": msg.content}, {"role": "user", "content": "again"}]
    if token % 5 == 1:  # the agent rewrites its history: the next call cannot continue the row
        messages = [messages[0], {"role": "user", "content": "redo " + example["prompt"]}]
    last = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
    return len(last.choices[0].message.content or "") / 4.0


async def one_to_four_calls(client: openai.AsyncOpenAI, example: dict) -> float:
    """A conversation of 1 to 4 calls, how many chosen by the first sampled token: episodes of
    one prompt end at different times (partial rollouts pause the ones still going)."""
    messages = [{"role": "user", "content": example["prompt"]}]
    r = await client.chat.completions.create(model="policy", messages=messages)
    calls = 1 + r.model_extra["generation_token_ids"][0] % 4
    for _ in range(calls - 1):
        reply = {"role": "assistant", "content": r.choices[0].message.content}
        messages += [reply, {"role": "user", "content": "go on"}]
        r = await client.chat.completions.create(model="policy", messages=messages)
    return float(calls)
