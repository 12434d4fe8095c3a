"""The OpenAI-compatible agent endpoint, over real HTTP with the real `openai` client and the HF
engine on a tiny chat model: token-exact rows from an agent's calls, forks, the key, failures,
batching of concurrent calls."""

import asyncio
import json
import socket

import httpx
import openai
import pytest
import torch

from verl_ds.data.chat import ChatCodec
from verl_ds.data.tiny import build_chat_tokenizer, build_tiny_llama, load_tokenizer
from verl_ds.errors import ConfigError, RunFailure
from verl_ds.rollout import HFRollout
from verl_ds.rollout.agents import EPISODE_HEADER, AgentServer, run_agents
from verl_ds.rollout.episodes import Sampling, SeedKey

MAX_NEW = 24  # the random tiny model ends some turns with eos and runs others to the budget


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    d = build_tiny_llama(tmp_path_factory.mktemp("agent_chat") / "model", build_chat_tokenizer(), max_len=512)
    tok = load_tokenizer(d)
    codec = ChatCodec(tok, True, model="tiny-chat", eos_ids=[tok.eos_token_id])
    return HFRollout(str(d), "fp32"), tok, codec


def _run(chat_model, agent, examples, n, **kw):
    engine, _, codec = chat_model
    sampling = Sampling(n=n, temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW)
    return run_agents(agent, examples, engine, codec, sampling, max_model_len=512, seed=SeedKey(3, 1), **kw)


def test_an_agents_calls_are_one_token_exact_row(chat_model):
    """Three calls per episode, each appending the assistant's reply and a new user message, from the
    real `openai.AsyncOpenAI` client: each episode is one row whose ids are the one-shot template
    rendering of the whole conversation; its model tokens (mask 1) are exactly what the engine
    sampled, with its logprobs; the user turns and the template's turn boundaries between them are
    environment tokens (mask 0, logprob 0). Concurrent episodes' calls share engine calls."""
    engine, tok, codec = chat_model
    seen: list[list] = []  # per agent: (messages sent, response) per call

    async def agent(client: openai.AsyncOpenAI, example: dict) -> float:
        messages = [{"role": "user", "content": example["prompt"]}]
        calls = []
        for turn in range(3):
            # the trainer's sampling wins over these: the response says which were overridden
            r = await client.chat.completions.create(
                model="policy", messages=messages, temperature=0.3, max_tokens=5, seed=7
            )
            calls.append((list(messages), r))
            messages = messages + [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": f"go on {turn}"},
            ]
        seen.append(calls)
        return float(len(r.choices[0].message.content))

    examples = [{"prompt": "Count: 1 2 3"}, {"prompt": "Say hi"}]
    ro = _run(chat_model, agent, examples, 2, batch_window_s=0.3)
    assert len(ro.batch) == 4 and ro.metrics["multi_turn/forks"] == 0.0 and ro.metrics["agent/failures"] == 0.0
    assert ro.metrics["agent/calls/mean"] == 3.0
    assert ro.metrics["multi_turn/token_mismatch_fraction"] == 0.0
    # 12 calls in fewer engine calls: concurrent episodes were batched
    assert ro.metrics["agent/requests_per_engine_call/mean"] > 1.0
    assert ro.batch.group_ids.tolist() == [0, 0, 1, 1] and ro.episode.tolist() == [0, 1, 2, 3]
    lists = ro.batch.to_lists()
    nl, eos = tok("\n", add_special_tokens=False)["input_ids"], tok.eos_token_id
    finishes = []
    rows_checked = 0
    masks = [ro.batch.loss_mask[i, : len(r)].tolist() for i, r in enumerate(lists["responses"])]
    for i, (p, r, lp, m) in enumerate(zip(lists["prompts"], lists["responses"], lists["logprobs"], masks)):
        # the agent whose sampled ids are exactly this row's model tokens
        model_ids = [t for t, k in zip(r, m) if k == 1.0]
        match = [c for c in seen if sum((x[1].model_extra["generation_token_ids"] for x in c), []) == model_ids]
        assert match, f"row {i}: its model tokens are not the ids the engine sampled for any agent"
        calls = match[0]
        assert ro.env_rewards[i] == len(calls[-1][1].choices[0].message.content)  # the agent's reward, per row
        last_msgs, last = calls[-1]
        conversation = last_msgs + [{"role": "assistant", "content": last.choices[0].message.content}]
        one_shot = codec.render_ids(conversation)
        ours = p + r
        tail = nl if last.choices[0].finish_reason == "stop" else [eos] + nl  # what the model never generated
        assert ours + tail == one_shot
        # model tokens carry the engine's logprobs, environment tokens mask 0 and logprob 0
        assert [x for x, k in zip(lp, m) if k == 1.0] == sum(
            (x[1].model_extra["generation_log_probs"] for x in calls), []
        )
        assert all(x == 0.0 for x, k in zip(lp, m) if k == 0.0)
        # each call's prompt is the row so far: the environment tokens are exactly the ids in between
        pos = 0
        for k, (_, resp) in enumerate(calls):
            extra = resp.model_extra
            fed = extra["prompt_token_ids"]
            assert fed == (p + r)[: len(fed)] and all(mm == 0.0 for mm in m[pos : len(fed) - len(p)])
            gen = extra["generation_token_ids"]
            start = len(fed) - len(p)
            assert r[start : start + len(gen)] == gen and all(mm == 1.0 for mm in m[start : start + len(gen)])
            pos = start + len(gen)
            assert set(extra["verl_ds"]["overridden"]) == {"temperature", "max_tokens", "seed"}
            assert extra["verl_ds"]["sampling"]["temperature"] == 1.0 and extra["verl_ds"]["continues_row"] == (k > 0)
            finishes.append(resp.choices[0].finish_reason)
        rows_checked += 1
    assert rows_checked == 4
    # both ways a turn ends were continued: after the model's eos (the user turn's ids appended), and
    # after a turn cut at the budget (the template's closing of it is environment tokens)
    non_last = [f for k, f in enumerate(finishes) if k % 3 != 2]
    assert "stop" in non_last and "length" in non_last


def test_the_engine_returned_those_logprobs(chat_model):
    """The logprobs a response reports are the engine's: the same prompt ids and seed, generated
    alone, give the same ids and logprobs."""
    engine, _, codec = chat_model
    got = []

    async def agent(client, example):
        r = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": example["prompt"]}])
        got.append(r.model_extra)
        return 1.0

    _run(chat_model, agent, [{"prompt": "a"}, {"prompt": "bcd"}], 2, batch_window_s=0.3)
    for extra in got:
        s = extra["verl_ds"]["sampling"]
        alone = engine.generate([extra["prompt_token_ids"]], 1, 1.0, 1.0, s["max_tokens"], seeds=[s["seed"]])
        rows = alone.to_lists()
        assert rows["responses"][0] == extra["generation_token_ids"]
        assert torch.allclose(torch.tensor(rows["logprobs"][0]), torch.tensor(extra["generation_log_probs"]), atol=1e-4)


def test_an_agent_that_edits_history_forks_a_new_row(chat_model):
    _, _, codec = chat_model

    async def agent(client, example):
        r1 = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "first question"}])
        edited = [
            {"role": "user", "content": "first question, reworded"},
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": "and then?"},
        ]
        r2 = await client.chat.completions.create(model="p", messages=edited)
        assert r2.model_extra["verl_ds"]["continues_row"] is False
        assert r2.model_extra["prompt_token_ids"] == codec.render_ids(edited, add_generation_prompt=True)
        return 0.5

    ro = _run(chat_model, agent, [{"prompt": "x"}], 1)
    assert len(ro.batch) == 2 and ro.episode.tolist() == [0, 0] and ro.metrics["multi_turn/forks"] == 1.0
    lists = ro.batch.to_lists()
    assert lists["prompts"][1] == codec.render_ids(ro.episodes[0].segments[1].messages[:-1], add_generation_prompt=True)
    # neither row holds environment tokens: each is one call's prompt and the model's reply
    assert torch.equal(ro.batch.loss_mask, ro.batch.response_mask) and not ro.batch.multi_turn
    assert ro.env_rewards.tolist() == [0.5, 0.5]


def test_a_completions_agent_continues_its_row_as_ids_and_forks_on_an_edit(chat_model):
    """`/v1/completions` through the real client: a prompt that is the previous prompt and its
    completion, then new text, continues the row (the sampled ids kept, only the new text tokenized:
    environment tokens); a prompt given as ids that extend the row continues it too; a rewritten
    prompt forks. Rows carry the engine's logprobs on model tokens."""
    _, _, codec = chat_model
    seen = []

    async def agent(client: openai.AsyncOpenAI, example: dict) -> float:
        text, calls = example["prompt"], []
        for turn in range(3):
            r = await client.completions.create(model="p", prompt=text, max_tokens=4)
            assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
            calls.append(r)
            text = text + r.choices[0].text + f" next {turn}:"
        extra = calls[-1].model_extra
        ids = extra["prompt_token_ids"] + extra["generation_token_ids"] + codec.content_ids(" ids")
        r = await client.completions.create(model="p", prompt=ids)  # token ids that extend the row
        assert r.model_extra["verl_ds"]["continues_row"] and r.model_extra["prompt_token_ids"] == ids
        calls.append(r)
        fork = await client.completions.create(model="p", prompt="rewritten " + text)
        assert not fork.model_extra["verl_ds"]["continues_row"]
        seen.append((calls, fork))
        return 1.0

    ro = _run(chat_model, agent, [{"prompt": "Count: 1 2"}], 1)
    assert len(ro.batch) == 2 and ro.metrics["multi_turn/forks"] == 1.0 and ro.metrics["agent/failures"] == 0.0
    # a text row's strict check: its ids are what the tokenizer makes of its whole text
    assert ro.metrics["multi_turn/token_mismatch_fraction"] == 0.0
    calls, fork = seen[0]
    assert [c.model_extra["verl_ds"]["continues_row"] for c in calls] == [False, True, True, True]
    lists = ro.batch.to_lists()
    p, r = lists["prompts"][0], lists["responses"][0]
    m = ro.batch.loss_mask[0, : len(r)].tolist()
    assert p == codec.content_ids("Count: 1 2")
    model = [t for t, k in zip(r, m) if k == 1.0]
    assert model == sum((c.model_extra["generation_token_ids"] for c in calls), [])
    lp = [x for x, k in zip(lists["logprobs"][0], m) if k == 1.0]
    assert lp == sum((c.model_extra["generation_log_probs"] for c in calls), [])
    # between the calls: exactly the new text's ids, as environment tokens
    env = [t for t, k in zip(r, m) if k == 0.0]  # the ids call followed the third call's completion
    assert env == sum((codec.content_ids(f" next {t}:") for t in range(2)), []) + codec.content_ids(" ids")
    assert lists["prompts"][1] == fork.model_extra["prompt_token_ids"]
    assert fork.model_extra["prompt_token_ids"] == codec.content_ids(
        "rewritten " + "Count: 1 2" + "".join(c.choices[0].text + f" next {t}:" for t, c in enumerate(calls[:3]))
    )


@pytest.mark.parametrize(
    "prompt, message",
    [(["a", "b"], "one prompt per request"), ([1, -2], "one string or one list"), ([10**9], "not in the vocabulary")],
)
def test_a_completions_prompt_the_endpoint_cannot_serve_is_a_400(chat_model, prompt, message):
    engine, _, codec = chat_model
    with AgentServer(engine, codec) as server:
        r = httpx.post(
            f"{server.base_url}/completions",
            json={"model": "p", "prompt": prompt},
            headers={"Authorization": f"Bearer {server.api_key}"},
            trust_env=False,
        )
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_a_tensor_parallel_groups_episodes_go_back_to_the_rank_whose_examples_they_played():
    """Under TP the group's first rank plays every member's examples, in rank order; each member gets
    the episodes of its own examples, their groups renumbered from 0, each with its rows' checks."""
    from verl_ds.rollout.agents import Played
    from verl_ds.rollout.episodes import Episode

    eps = [Episode(group=g, sample=j, env=None, reward=10 * g + j) for g in range(4) for j in range(2)]
    played = Played(eps, [[bool(e.group % 2)] for e in eps], [3, 5])
    first, second = played.split([1, 3])
    assert [(e.group, e.reward) for e in first.episodes] == [(0, 0), (0, 1)]
    assert [(e.group, e.reward) for e in second.episodes] == [(0, 10), (0, 11), (1, 20), (1, 21), (2, 30), (2, 31)]
    assert second.exact == [[True], [True], [False], [False], [True], [True]] and first.exact == [[False], [False]]
    assert first.engine_calls == second.engine_calls == [3, 5]


def test_the_key_is_required_and_only_loopback_is_bound(chat_model):
    engine, _, codec = chat_model
    with AgentServer(engine, codec, Sampling(n=1, temperature=1.0, top_p=1.0, max_new_tokens=4), 512) as server:
        assert server.host == "127.0.0.1"
        bound = [s.getsockname()[0] for srv in server._server.servers for s in srv.sockets]
        assert bound == ["127.0.0.1"]
        url = server.base_url + "/chat/completions"
        body = {"model": "p", "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(trust_env=False) as http:
            assert http.post(url, json=body).status_code == 401
            assert http.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
            ok = http.post(url, json=body, headers={"Authorization": f"Bearer {server.api_key}", EPISODE_HEADER: "e"})
            assert ok.status_code == 200 and ok.json()["generation_token_ids"]
            bad = http.post(url, json={"messages": []}, headers={"Authorization": f"Bearer {server.api_key}"})
            assert bad.status_code == 400

        async def with_wrong_key():
            client = openai.AsyncOpenAI(
                base_url=server.base_url,
                api_key="not-the-key",
                max_retries=0,
                http_client=httpx.AsyncClient(trust_env=False),
            )
            with pytest.raises(openai.AuthenticationError):
                await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
            await client.close()

        asyncio.run(with_wrong_key())
        # another address of this machine does not reach it
        other = socket.gethostbyname(socket.gethostname())
        if not other.startswith("127."):
            with pytest.raises(OSError):
                socket.create_connection((other, server.port), timeout=2).close()
    assert len(server.api_key) >= 32 and AgentServer(engine, codec).api_key != server.api_key  # a secret per run


def test_an_agent_that_raises_or_hangs_is_counted_and_the_others_return(chat_model):
    async def agent(client, example):
        r = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": example["prompt"]}])
        if example["prompt"] == "raise":
            raise RuntimeError("the agent's own bug")
        if example["prompt"] == "hang":
            await asyncio.sleep(60)
        return 1.0 + len(r.choices[0].message.content) * 0

    examples = [{"prompt": "ok"}, {"prompt": "raise"}, {"prompt": "hang"}, {"prompt": "ok too"}]
    ro = _run(chat_model, agent, examples, 1, timeout_s=5.0)
    assert ro.metrics["agent/failures"] == 2.0
    assert ro.env_rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert ro.episodes[1].failure.startswith("RuntimeError") and "timed out" in ro.episodes[2].failure
    assert len(ro.batch) == 4  # the failed episodes' calls are rows too, with reward 0


def test_an_agent_that_is_not_an_async_function_is_one_line_before_anything_runs(chat_model):
    def sync_agent(client, example):
        return 1.0

    async def no_example(client):
        return 1.0

    with pytest.raises(ConfigError, match="sync_agent.*is not an `async def agent"):
        _run(chat_model, sync_agent, [{"prompt": "x"}], 1)
    with pytest.raises(ConfigError, match="must take"):
        _run(chat_model, no_example, [{"prompt": "x"}], 1)


@pytest.mark.numerics
def test_the_trainer_scores_an_agents_rows_as_the_engine_sampled_them(chat_model):
    """The rows are trainable as they are: a real Reference engine scoring them (environment tokens
    attended to, not scored) gives the rollout's logprobs on every model token."""
    from tests.rollout.test_episodes import trainer_logprobs_match_on_model_tokens

    engine = chat_model[0]

    async def agent(client, example):
        messages = [{"role": "user", "content": example["prompt"]}]
        for _ in range(3):
            r = await client.chat.completions.create(model="p", messages=messages)
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "more"},
            ]
        return 1.0

    ro = _run(chat_model, agent, [{"prompt": "abc"}, {"prompt": "xyz"}], 2)
    assert ro.batch.multi_turn and len(ro.batch) == 4 and ro.metrics["multi_turn/forks"] == 0.0
    assert trainer_logprobs_match_on_model_tokens(ro, engine.model_path) <= 1e-5


class ScriptedEngine:
    """A stand-in engine for the tool-call logic alone (the tiny random model never writes a tool
    call): each engine call answers every request with the next scripted text, as ids, with eos.
    What it is fed is kept, to check the ids the server built."""

    tp = 1

    def __init__(self, tok, texts):
        self.tok, self.texts, self.fed = tok, list(texts), []
        self.pad_id = tok.pad_token_id

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=16, seeds=None, top_k=0):
        from verl_ds.rollout import RolloutBatch

        self.fed += [list(p) for p in prompts]
        ids = self.tok(self.texts.pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        k = len(prompts)
        return RolloutBatch.from_lists(
            prompts, [ids] * k, [[-0.5] * len(ids)] * k, ["stop"] * k, list(range(k)), pad_id=self.pad_id
        )


def test_a_tool_call_comes_back_as_openai_tool_calls_and_its_result_continues_the_row(chat_model):
    """`tools=` in the request reaches the template; a hermes `<tool_call>` in the sampled text is
    returned as OpenAI `tool_calls` (finish_reason tool_calls); the agent's usual next request
    (the assistant message with those tool_calls, then a `tool` message) continues the same row:
    the reply's sampled ids stay as they were, the tool result is environment tokens. A call under
    other tools forks (the template's tools section changed)."""
    from tests.e2e.agents import CALCULATOR
    from verl_ds.envs import parse_hermes_tool_calls

    _, tok, codec = chat_model
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    engine = ScriptedEngine(tok, [call, "3", "4"])
    seen = {}

    async def agent(client: openai.AsyncOpenAI, example: dict) -> float:
        messages = [{"role": "user", "content": example["prompt"]}]
        r = await client.chat.completions.create(model="p", messages=messages, tools=[CALCULATOR])
        seen["first"] = r
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        for c in msg.tool_calls:
            args = json.loads(c.function.arguments)
            messages.append({"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])})
        seen["second"] = await client.chat.completions.create(model="p", messages=messages, tools=[CALCULATOR])
        messages.append({"role": "assistant", "content": seen["second"].choices[0].message.content})
        messages.append({"role": "user", "content": "and without tools?"})
        seen["third"] = await client.chat.completions.create(model="p", messages=messages)
        return 1.0

    sampling = Sampling(n=1, temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW * 4)
    ro = run_agents(agent, [{"prompt": "1+2"}], engine, codec, sampling, 512, tool_parser=parse_hermes_tool_calls)
    first = seen["first"]
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    (tc,) = first.choices[0].message.tool_calls
    assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 1, "b": 2}
    assert '"name": "add"' in tok.decode(engine.fed[0]), "the tools did not reach the template"
    assert seen["second"].model_extra["verl_ds"]["continues_row"] is True
    assert seen["third"].model_extra["verl_ds"]["continues_row"] is False  # other tools (none): a fork
    assert len(ro.batch) == 2 and ro.metrics["multi_turn/token_mismatch_fraction"] == 0.0
    # row 1: the tool call's sampled ids (mask 1), the tool result (mask 0), the answer (mask 1)
    row = ro.batch.to_lists()["responses"][0]
    mask = ro.batch.loss_mask[0, : len(row)].tolist()
    sampled = first.model_extra["generation_token_ids"]
    assert row[: len(sampled)] == sampled and mask[: len(sampled)] == [1.0] * len(sampled)
    between = tok.decode([t for t, m in zip(row, mask) if m == 0.0])
    assert "<|im_start|>tool\n3<|im_end|>" in between
    prompt = ro.batch.to_lists()["prompts"][0]
    assert engine.fed[1] == prompt + row[: len(engine.fed[1]) - len(prompt)]  # the row's own ids so far


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.multi_turn.env=retry", "data.apply_chat_template=true"], "set rollout.multi_turn.env or .agent"),
        ([], "the agent's endpoint renders chat messages: set data.apply_chat_template: true"),
    ],
)
def test_an_agent_job_the_endpoint_cannot_serve_is_one_line_at_start(overrides, message):
    """(The CLI's exit 2 for a bad agent path: tests/config's BAD_INPUTS.)"""
    from verl_ds.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, ["rollout.multi_turn.agent=tests.e2e.agents:three_calls", *overrides], world_size=2)


def test_an_agent_returning_no_number_is_one_line_naming_it(chat_model):
    """The contract itself (a finite reward), not an unlucky episode: a ConfigError naming the agent and
    what it returned, raised through the run, where an exception inside the agent is only counted."""

    async def returns_text(client, example):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": example["prompt"]}])
        return "1.0"

    with pytest.raises(ConfigError) as e:
        _run(chat_model, returns_text, [{"prompt": "ok"}], 1)
    line = str(e.value)
    assert line.startswith("rollout.multi_turn.agent: ") and "returns_text" in line
    assert "returned '1.0' (str): an agent returns its episode's reward, a finite number" in line


def test_agent_failures_past_the_bound_stop_the_run_and_below_it_are_one_line(caplog):
    """`check_agent_failures`: more than the fraction raised or timed out -> RunFailure in one line;
    fewer -> one warning line counting each kind (tracebacks are at DEBUG)."""
    from verl_ds.rollout.agents import check_agent_failures
    from verl_ds.rollout.episodes import Episode

    def ep(failure):
        return Episode(group=0, sample=0, env=None, segments=[], failure=failure)

    eps = [ep("AgentBroke: gave up"), ep("timed out after 5.0s"), ep(""), ep("AgentBroke: again")]
    with pytest.raises(RunFailure) as e:
        check_agent_failures(eps, 0.5)
    assert "3 of 4 agent episodes raised or timed out (> rollout.multi_turn.max_agent_failure_fraction 0.5)" in str(
        e.value
    )
    caplog.set_level("WARNING", logger="verl_ds")
    check_agent_failures(eps, 0.75)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "2 x AgentBroke, 1 x timed out after 5.0s" in lines[0]
