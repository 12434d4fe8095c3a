"""Built-in task, rule rewards and their registry, the resumable sampler, prompt files."""

import json

import pytest

from verl_ds.data.chat import ChatCodec
from verl_ds.data.dataset import PromptSampler, tokenize_prompts
from verl_ds.data.reward import arithmetic_reward, get_reward_fn, gsm8k_reward, last_number_reward
from verl_ds.data.tasks import arithmetic_examples, load_examples
from verl_ds.errors import ConfigError


def test_arithmetic_task_is_seeded_and_correct():
    a = arithmetic_examples(50, seed=3, min_value=0, max_value=9, num_operands=3, ops="+-*")
    assert a == arithmetic_examples(50, seed=3, min_value=0, max_value=9, num_operands=3, ops="+-*")
    for ex in a:
        assert str(eval(ex["prompt"][:-1])) == ex["answer"] and ex["prompt"].endswith("=")
    with pytest.raises(ConfigError, match="data.arithmetic.ops"):
        arithmetic_examples(1, seed=0, ops="/")


def test_rule_rewards():
    assert arithmetic_reward("7", "7") == 1.0 and arithmetic_reward("71", "7") == 0.0
    assert arithmetic_reward("work... #### 7", "7") == 1.0
    assert gsm8k_reward("so #### 1,234", "steps\n#### 1234") == 1.0
    assert gsm8k_reward("1234", "#### 1234") == 0.0  # the format is required
    assert last_number_reward("The answer is 12.", "12") == 1.0
    assert get_reward_fn("gsm8k") is gsm8k_reward
    assert get_reward_fn("verl_ds.data.reward:last_number_reward") is last_number_reward
    with pytest.raises(ConfigError, match="data.reward_fn"):
        get_reward_fn("no_such_reward")


def test_sampler_resumes_at_the_same_position():
    s = PromptSampler(10, seed=0)
    s.next(7)
    state = s.state_dict()
    want = s.next(9)  # crosses an epoch boundary
    t = PromptSampler(10, seed=0)
    t.load_state_dict(state)
    assert t.next(9) == want


def test_prompt_files_with_chat_free_tokenization(tmp_path, tokenizer):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) for i in range(3)))

    from verl_ds.config import DataConfig

    D = DataConfig(task="files", train_files=[str(f)], prompt_key="q", answer_key="a")
    train, val = load_examples(D)
    assert val == []
    rows = tokenize_prompts(train, ChatCodec(tokenizer, False), max_prompt_length=5)
    assert [r["answer"] for r in rows] == ["1", "2", "3"]
    assert rows[0]["prompt_ids"][0] == tokenizer.bos_token_id and len(rows[0]["prompt_ids"]) == 5
    short = tokenize_prompts(load_examples(D)[0], ChatCodec(tokenizer, False), max_prompt_length=4)
    assert short[0]["prompt_ids"] == rows[0]["prompt_ids"][1:]  # over-long prompts keep their tail
    D.prompt_key = "missing"
    with pytest.raises(ConfigError, match="data.prompt_key"):
        load_examples(D)


def test_tokenize_prompts_batched_equals_one_call_per_row(tokenizer):
    """Distinct prompts are tokenized once in one call: every row still gets its own prompt's ids,
    with and without the chat template (whose text already holds the special tokens)."""
    import copy

    rows = [{"prompt": p, "answer": "x"} for p in ["1+2=", "3+4=", "1+2=", "10+2=", "3+4="]]
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    for tok, templated in ((tokenizer, False), (chat, True)):
        out = tokenize_prompts(rows, ChatCodec(tok, templated), max_prompt_length=32)
        for r, o in zip(rows, out):
            text = (
                tok.apply_chat_template(
                    [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False
                )
                if templated
                else r["prompt"]
            )
            want = tok(text, add_special_tokens=not templated)["input_ids"]
            assert o["prompt_ids"] == want and o["prompt"] == r["prompt"]
        assert out[0]["prompt_ids"][0] == tok.bos_token_id and out[0]["prompt_ids"][1] != tok.bos_token_id
    assert tokenize_prompts([], ChatCodec(tokenizer, False), 4) == []


def test_held_out_split_is_disjoint_and_seeded():
    from verl_ds.data.tasks import held_out_split

    rows = arithmetic_examples(2000, seed=0)
    train, val = held_out_split(rows, 0.2, seed=0)
    held = {r["prompt"] for r in val}
    assert len(held) == len(val) == 5  # 20% of the 25 distinct a+b problems
    assert not held & {r["prompt"] for r in train}  # validation prompts never train
    assert len(train) + sum(r["prompt"] in held for r in rows) == len(rows)
    assert held_out_split(rows, 0.2, seed=0)[1] == val and held_out_split(rows, 0.2, seed=1)[1] != val
    assert held_out_split(rows, 0.0, seed=0) == (rows, [])


def test_reasoning_gym_task_split_and_own_scorer():
    from verl_ds.config import DataConfig
    from verl_ds.data.reasoning_gym import final_answer
    from verl_ds.data.reward import task_reward_fn

    d = DataConfig(task="reasoning_gym", reward_fn="reasoning_gym")
    d.reasoning_gym.size, d.reasoning_gym.val_size = 50, 20
    train, val = load_examples(d)
    assert len(train) == 50 and 0 < len(val) <= 20
    assert not {e["prompt"] for e in val} & {e["prompt"] for e in train}  # disjoint questions
    reward = task_reward_fn(d)
    gold = json.loads(train[0]["answer"])["answer"]
    assert reward(f"Let me think.\nAnswer: {gold}", train[0]["answer"]) == 1.0
    assert reward("Answer: definitely not a number", train[0]["answer"]) == 0.0
    assert reward("", "not json") == 0.0  # never raises
    assert final_answer("x\nAnswer: 12\n") == "12" and final_answer("just 7") == "just 7"
    # numeric tasks: the last number of the Answer line, else of the whole response
    assert final_answer("Answer: 3 + 4 = 7.", numeric=True) == "7"
    assert final_answer("93 - 95 = -2\nDone.", numeric=True) == "-2"
    assert final_answer("no digits here", numeric=True) == ""
    assert (
        reward(f"{gold} is it, I think" if gold.lstrip("-").isdigit() else f"Answer: {gold}", train[0]["answer"]) == 1.0
    )
    d.reasoning_gym.name = "products"
    d.reasoning_gym.reward_threshold = 1.0
    products = load_examples(d)[0]
    entry = json.loads(products[0]["answer"])
    assert task_reward_fn(d)("Answer: 1", products[0]["answer"]) in (0.0, 1.0)  # partial credit -> 0/1
    assert task_reward_fn(d)(f"Answer: {entry['answer']}", products[0]["answer"]) == 1.0
