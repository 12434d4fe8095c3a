"""TRL's GRPOTrainer on a verl-ds job, for the side-by-side table (benchmarks/side_by_side.py).

Runs INSIDE benchmarks/.venv-trl (bash benchmarks/setup_trl.sh), never in the project's .venv:
    benchmarks/.venv-trl/bin/python benchmarks/trl_grpo.py --job quickstart [--steps 10] [key=value ...]
Prints one JSON line last: {"job", "steps", "s_per_step", "episodes_per_s", "wall_s", "reward_first5",
"reward_last10", ...} (episodes = trainer.prompts_per_step x rollout.n a step; tool jobs add tool counts).
`--show-episodes N` prints N finished episodes (TRL's completion messages) of the first step to stderr.

The job is read from the same YAML verl-ds trains on (verl_ds.config.load_config, with the same
overrides), so both sides share one source of truth: the tiny model (verl_ds.data.tiny, same seed, so
the same initial weights), the prompts (verl_ds.data.tasks.load_examples: the same train split) and
the reward function (verl_ds.data.reward). verl_ds is imported from the repo root (it needs only torch,
transformers, tokenizers and pyyaml here).

Mapping (verl-ds -> TRL 1.16):
  rollout.n -> num_generations; trainer.prompts_per_step x n -> generation batch
  algorithm.ppo_epochs -> num_iterations (each rollout batch is reused for that many passes)
  roles.actor.micro_batch_size x verl-ds's ranks -> per_device_train_batch_size (one process here does
      what verl-ds's ranks do together; with max_tokens_per_micro_batch, the rows that fit the budget
      at the longest prompt, rounded down to a divisor of the mini batch); mini batch (0: whole
      batch) -> gradient_accumulation_steps
  rollout.max_new_tokens -> max_completion_length; rollout.temperature/top_p -> temperature/top_p, top_k=0
  roles.actor.lr/weight_decay/betas -> learning_rate/weight_decay/adam_beta1,2, constant schedule, no warm-up
  algorithm.kl_coef (use_kl_loss, k3) -> beta; clip_low/clip_high -> epsilon/epsilon_high
  loss_agg_mode token-mean -> loss_type "dapo" (token mean over the whole accumulated batch)
  trainer.max_grad_norm -> max_grad_norm; precision.enable_grad_checkpointing -> gradient_checkpointing
  trainer.seed -> seed; a "step" below is one rollout step (= ppo_epochs x batch/mini optimizer steps)
Tool jobs (rollout.multi_turn.env: tools, e.g. smollm2_tools) -> GRPOTrainer(tools=[...]):
  data.tools -> tools: each verl-ds tool (verl_ds.envs.tools.load_tools) wrapped with its own name, type
      hints and docstring; the wrapper answers what verl-ds's ToolEnv answers (its `_run`: the result as
      text, `error: ...` for a failing call, the same env_kwargs.timeout_s)
  prompts: verl-ds's own ChatCodec.prompt_messages (system message with the tool schemas, since
      SmolLM2's template has no tools section; data.few_shot; the question), checked to give the same
      prompt ids as verl-ds's tokenize_prompts; the ids TRL appends after a tool call are checked
      against ChatCodec.observation_ids
  tool-call parsing: TRL's qwen3 (hermes <tool_call>{json}</tool_call>) response template set on the
      tokenizer (add_response_schema does not know SmolLM2's template); SmolLM2's template is extended to
      render an assistant message's `tool_calls` as that hermes text (TRL refuses a template that drops
      them). Only messages with `tool_calls` render differently, and TRL never renders those into the ids
      the model sees (it concatenates ids: prompt + sampled ids + tool-result ids)
  rollout.multi_turn.max_turns -> max_tool_calling_iterations = max_turns - 1 (TRL: the first generation,
      then per iteration run the calls and generate once more; a turn past the limit is not executed)
  rollout.max_new_tokens (per model turn) -> generation_kwargs max_new_tokens (each generate call, also
      per turn); max_completion_length (TRL's budget for the whole completion, model + tool tokens) ->
      multi_turn.max_total_tokens, or rollout.max_model_len - the longest prompt (verl-ds's row bound)
  reward: data.reward_fn (with reasoning_gym's reward_threshold, as verl-ds's task_reward_fn) on the
      content of the completion's last assistant message

Differences that remain (TRL cannot express them, or they are how TRL works):
  - generation: TRL here uses plain transformers `generate` (no vLLM in this venv). verl-ds follows
    the yaml: the quickstart's `rollout.engine: auto` picks HF `generate` for its 330k model on CPU,
    SmolLM2's yaml uses vLLM (synced in place every step); job quickstart_vllm forces vLLM on the
    quickstart. On smollm2_tools TRL's HF `generate` (64 rows, ~300-token prompts, no shared prompt)
    is most of its step: one step took 1172 s with 2 threads on a 2-core box that was also running
    other work.
  - processes: TRL runs as ONE process with OMP_NUM_THREADS threads (side_by_side.py: 1 and all cores);
    verl-ds runs the job's DeepSpeed ranks (JOBS; ZeRO per the yaml, gloo), cores / ranks threads each.
  - optimizer: torch AdamW (TRL) vs DeepSpeed's AdamW (torch_adam) under ZeRO; same lr, betas, eps 1e-8.
  - GRPO advantage eps: (r - mean) / (std + 1e-4) in TRL, + 1e-6 in verl-ds (both unbiased std).
  - KL: both k3 in the loss; use_bias_correction_kl=False so TRL does not weight it by the ratio (as
    verl-ds). verl-ds clamps the k3 log-ratio/estimate; TRL does not.
  - prompt truncation: TRL 1.16 has no max_prompt_length; prompts are checked to fit instead.
  - no validation, no memory accounting, no W&B on either side (side_by_side.py turns them off in
    verl-ds); verl-ds writes its final checkpoint + HF export at the end, TRL saves the HF model only.
  - precision: fp32 only here (TRL's bf16 flag is autocast with fp32 weights, not verl-ds's bf16 roles).
  Tool jobs:
  - generation: TRL runs each turn as one padded HF `generate` over the live episodes (turn 0: the whole
    batch); verl-ds sends each turn's live episodes to vLLM (prefix cache over the earlier turns).
  - tool-call parsing: verl-ds runs a call in a turn cut before `</tool_call>` (its JSON may be whole) and
    answers malformed JSON with `error: ...` (the episode goes on); TRL's parser reads such a turn as
    plain text: no call, the episode ends there (reward 0). The untrained SmolLM2 writes such calls
    often: 6 of 32 sampled first turns (19%; e.g. {"expression": 10 - 46 - 21}, unquoted), so at the
    start TRL's episodes have fewer turns and calls (1-step smoke: 1.45 turns, 0.45 calls an episode;
    verl-ds's step 1 in the example: 1.81 and 0.86). Compare work per episode (the result JSON's
    turns_per_episode, tool_calls_per_episode) along with s/step.
  - tool results: verl-ds cuts a result to multi_turn.max_env_tokens tokens, TRL never cuts (calculator
    results are a few tokens); a call with wrong argument names gets TRL's `{'error': ...}` text instead
    of verl-ds's `error: TypeError: ...`.
  - budget: verl-ds ends an episode whose next turn would not fit (finish: length), TRL cuts the last turn
    at max_completion_length; per-turn caps are the same (max_new_tokens), so neither binds here.
  - metrics: TRL's tools/call_frequency is calls per episode, verl-ds's calls per model turn; the result
    JSON carries calls per episode and per model turn for both (side_by_side.py).
  - the reward reads the final message's parsed content (TRL strips the tool-call text and whitespace);
    verl-ds scores the final turn's decoded text.
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# job -> (yaml, overrides applied to BOTH sides, default steps, verl-ds ranks). The overrides make it a
# training-speed job: fp32 everywhere, no validation, no memory accounting, no W&B, checkpoint only at
# the end. Ranks: verl-ds's faster layout on a 2-core box (each rank gets cores / ranks threads): two
# 1-thread ranks for the tiny model, one 2-thread rank for SmolLM2 (two ranks there each load the
# whole model into their own vLLM engine and all-reduce 0.5 GB of gradients every step).
_COMMON = [
    "trainer.val_every=0",
    "trainer.val_before_train=false",
    "logging.memory_every=0",
    "logging.wandb.mode=disabled",
    "checkpoint.every=0",
    "precision.actor_dtype=fp32",
    "precision.reference_dtype=fp32",
    "precision.rollout_dtype=fp32",
]
JOBS = {
    "quickstart": ("examples/grpo_cpu_tiny.yaml", _COMMON, 120, 2),
    # the same job with verl-ds sampling through vLLM instead of the example's auto -> HF `generate`:
    # what vLLM's import, engine start and per-request overhead cost on a 330k-parameter model
    "quickstart_vllm": ("examples/grpo_cpu_tiny.yaml", _COMMON + ["rollout.engine=vllm"], 120, 2),
    # one rank takes the 16 rows per micro-batch that two ranks of 8 took (TRL's per-device batch: 16 either way)
    "smollm2": (
        "examples/grpo_cpu_smollm2.yaml",
        _COMMON + ["roles.actor.micro_batch_size=16", "roles.reference.micro_batch_size=16"],
        4,
        1,
    ),
    # agentic: SmolLM2 with the calculator tool (up to 3 turns of 48 tokens), the example's 8 prompts x 8
    # episodes and micro-batches of 8; TRL runs GRPOTrainer(tools=[calculator]) on the same prompts
    "smollm2_tools": ("examples/grpo_cpu_smollm2_tools.yaml", _COMMON, 3, 1),
    # long shared prompts: ~1.5k-token few-shot prompts (solved sums, then the question; the data file that
    # benchmarks/shared_prefix.py writes, made by side_by_side.py), 1 prompt x 8 samples of 16 tokens a step,
    # the example's gradient checkpointing: verl-ds runs each prompt once (roles/prefix.py), TRL 8 times
    "smollm2_fewshot": (
        "examples/grpo_cpu_smollm2.yaml",
        _COMMON
        + ["data.task=files", "data.train_files=[runs/bench_trl/fewshot.jsonl]", "data.max_prompt_length=1664"]
        + ["rollout.max_model_len=1696", "trainer.prompts_per_step=1", "rollout.n=8", "rollout.max_new_tokens=16"]
        + ["roles.actor.micro_batch_size=8", "roles.reference.micro_batch_size=8"],
        3,
        1,
    ),
    # a long tail: the real-model demo's task (reasoning-gym two-digit arithmetic, 8 prompts x 8) with room
    # to answer (max_new_tokens 96): a few samples run long and, padded, set most micro-batches' length
    "smollm2_long": (
        "examples/grpo_cpu_smollm2_rg.yaml",
        _COMMON + ["rollout.max_new_tokens=96", "rollout.max_model_len=192", "precision.buffer_dtype=fp32"],
        4,
        1,
    ),
}


def num_ranks(job: str) -> int:
    """verl-ds's ranks for `job` (NUM_RANKS in the environment wins)."""
    return int(os.environ.get("NUM_RANKS") or JOBS[job][3])


def job_config(job: str, steps: int | None, extra: list[str]):
    from verl_ds.config import load_config

    path, overrides, default_steps, _ = JOBS[job]
    return load_config(ROOT / path, overrides + [f"trainer.steps={steps or default_steps}"] + extra)


def _fail(msg: str):
    sys.exit(f"trl_grpo.py: {msg}")


# An assistant message's `tool_calls`, rendered as the hermes text the model writes (and the few-shot
# demonstration shows): <tool_call>{"name": ..., "arguments": {...}}</tool_call>, after its content.
_HERMES_CALLS = (
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}{%- for tc in message['tool_calls'] %}"
    "{%- set f = tc['function'] if tc['function'] is defined else tc %}"
    "{{- '<tool_call>{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' + (f['arguments'] "
    "if f['arguments'] is string else (f['arguments'] | tojson)) + '}</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
)


def with_hermes_tool_calls(template: str) -> str:
    """SmolLM2's ChatML template, rendering `tool_calls` too (only messages that have them change)."""
    body = "message['content'] + '<|im_end|>'"
    if template.count(body) != 1:
        _fail("the chat template is not SmolLM2's ChatML one: cannot add hermes tool-call rendering")
    return template.replace(body, "message['content'] }}" + _HERMES_CALLS + "{{ '<|im_end|>'")


def trl_tools(tools: list, timeout_s: float) -> list:
    """Each verl-ds tool as TRL calls it: same name, schema, results and error texts as verl-ds's ToolEnv."""
    import functools

    from verl_ds.envs.tools import ToolEnv

    env = ToolEnv(tools, timeout_s=timeout_s)

    def wrap(fn):
        @functools.wraps(fn)  # __name__, __doc__, signature: the same JSON schema
        def tool(**kwargs):
            return env._run({"name": fn.__name__, "arguments": kwargs})

        return tool

    return [wrap(fn) for fn in tools]


def _mean_or_none(xs):
    return statistics.mean(xs) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", choices=sorted(JOBS), required=True)
    ap.add_argument("--steps", type=int, default=None, help="rollout steps (default: the job's)")
    ap.add_argument("--out-dir", default=None, help="TRL output dir, kept (default: a temporary one, removed)")
    ap.add_argument(
        "--show-episodes",
        type=int,
        default=0,
        metavar="N",
        help="print N episodes (completion messages) of the first step to stderr, tool calls first",
    )
    ap.add_argument("overrides", nargs="*", help="extra verl-ds key=value overrides (pass the same to both sides)")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    cfg = job_config(args.job, args.steps, args.overrides)

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl_ds.config import token_budget
    from verl_ds.data.chat import ChatCodec
    from verl_ds.data.dataset import tokenize_prompts
    from verl_ds.data.reward import task_reward_fn
    from verl_ds.data.tasks import load_examples
    from verl_ds.data.tiny import build_char_tokenizer, build_tiny_llama, load_tokenizer
    from verl_ds.envs.tools import load_tools, tool_schemas

    a, r, d, t, actor = cfg.algorithm, cfg.rollout, cfg.data, cfg.trainer, cfg.roles.actor
    p = cfg.precision
    if a.estimator != "grpo" or a.kl_estimator not in ("k3", "low_var_kl") or (a.kl_coef and not a.use_kl_loss):
        _fail("only estimator grpo with a k3 KL loss maps onto TRL's GRPOTrainer")
    if {p.actor_dtype, p.reference_dtype, p.rollout_dtype} != {"fp32"}:
        _fail("this comparison is fp32 only: pass precision.{actor,reference,rollout}_dtype=fp32")
    if a.loss_agg_mode != "token-mean" or a.policy_loss != "vanilla" or a.reward_normalization != "none":
        _fail("only loss_agg_mode token-mean, policy_loss vanilla, reward_normalization none map onto TRL here")
    mt = r.multi_turn
    if mt.env not in (None, "", "tools"):
        _fail(f"multi_turn.env {mt.env!r}: only the built-in `tools` environment maps onto TRL's tools=")
    tools = load_tools(d.tools) if mt.env == "tools" else []
    if mt.env == "tools" and not (tools and d.apply_chat_template):
        _fail("a tool job needs data.tools and data.apply_chat_template")
    if "reasoning_gym" in (d.task, d.reward_fn):
        try:
            import reasoning_gym  # noqa: F401
        except ImportError:
            _fail(
                "reasoning_gym is missing in this venv: benchmarks/.venv-trl/bin/python -m pip install "
                "reasoning-gym (side_by_side.py installs .venv's version)"
            )

    tmp = None if args.out_dir else tempfile.TemporaryDirectory(prefix="trl_grpo_")
    out_dir = Path(args.out_dir or tmp.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.model.path == "tiny":  # the same random init verl-ds builds in its run dir
        m = cfg.model.tiny
        model_path = str(
            build_tiny_llama(
                out_dir / "init_model",
                build_char_tokenizer(),
                hidden=m.hidden,
                layers=m.layers,
                heads=m.heads,
                ffn=m.ffn,
                seed=m.seed,
            )
        )
    else:
        model_path = str(ROOT / cfg.model.path) if not Path(cfg.model.path).is_absolute() else cfg.model.path
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or model_path)  # keeps the char pre-tokenizer

    train, _val = load_examples(d)
    # verl-ds's prompt messages: its system prompt (+ the tools' schemas when the template has no tools
    # section), the few-shot messages, the question
    codec = ChatCodec(
        tokenizer,
        d.apply_chat_template,
        tool_schemas(tools) if tools else None,
        d.system_prompt,
        model=cfg.model.path,
        few_shot=d.few_shot,
    )
    trl_tool_fns = trl_tools(tools, float((mt.env_kwargs or {}).get("timeout_s", 5.0))) if tools else []
    if d.apply_chat_template:  # verl-ds's prompt ids, before the template change below
        ours = [e["prompt_ids"] for e in tokenize_prompts(train[:256], codec, 10**9)]
    if tools:
        codec.check_turns()
        obs_ids = codec.observation_ids([{"role": "tool", "content": "35"}])
        tokenizer.chat_template = with_hermes_tool_calls(tokenizer.chat_template)
        from trl.chat_template_utils import qwen3_template

        tokenizer.response_template = qwen3_template  # TRL's hermes <tool_call>{json}</tool_call> parser
    if d.apply_chat_template:
        rows = [{"prompt": codec.prompt_messages(e["prompt"]), "answer": e["answer"]} for e in train]
        trl_ids = [
            tokenizer.apply_chat_template(
                x["prompt"], tools=trl_tool_fns or None, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            for x in rows[:256]
        ]
        if trl_ids != ours:
            _fail("TRL's prompt ids differ from verl-ds's (ChatCodec) for the same messages")
        longest = max(map(len, trl_ids))
    else:
        rows = [{"prompt": e["prompt"], "answer": e["answer"]} for e in train]
        longest = max(len(tokenizer(x["prompt"])["input_ids"]) for x in rows[:256])
    if longest > d.max_prompt_length:
        _fail(f"prompts of {longest} tokens > data.max_prompt_length {d.max_prompt_length} (TRL would not cut them)")
    dataset = Dataset.from_list(rows)

    score = task_reward_fn(d)  # verl-ds's: reasoning_gym's reward_threshold applied
    step_rewards: list[float] = []  # mean reward of each rollout batch (one reward call per generation)
    # per rollout batch: tool calls, failed calls (verl-ds's `error:` text or TRL's {'error': ...}), model turns
    tool_counts: list[tuple[int, int, int, int]] = []
    shown = [0]

    def final_text(c) -> str:
        if not isinstance(c, list):
            return c
        return next((m.get("content") or "" for m in reversed(c) if m["role"] == "assistant"), "")

    def reward(prompts, completions, answer, **_):
        out = [float(score(final_text(x), ans)) for x, ans in zip(completions, answer)]
        step_rewards.append(sum(out) / len(out))
        if tools:
            results = [str(m["content"]) for c in completions for m in c if m["role"] == "tool"]
            turns = sum(m["role"] == "assistant" for c in completions for m in c)
            tool_counts.append(
                (len(results), sum(x.startswith(("error:", "{'error'")) for x in results), turns, len(completions))
            )
        if shown[0] < args.show_episodes:
            order = sorted(
                range(len(completions)),
                key=lambda i: not any(isinstance(m, dict) and m.get("role") == "tool" for m in completions[i]),
            )
            for i in order[: args.show_episodes - shown[0]]:
                print(
                    f"[trl_grpo] episode (reward {out[i]}, answer {str(answer[i])[:200]!r}):\n"
                    + json.dumps(completions[i], indent=1, default=str),
                    file=sys.stderr,
                    flush=True,
                )
            shown[0] = args.show_episodes
        return out

    reward.__name__ = d.reward_fn

    batch = t.prompts_per_step * r.n
    mini = t.mini_batch_size or batch
    micro_rows = actor.micro_batch_size
    budget = token_budget(cfg, "actor")
    if budget:  # verl-ds's token budget: TRL's per-device batch holds as many full-length rows as fit it
        micro_rows = max(1, budget // (longest + r.max_new_tokens))
    per_device = max(k for k in range(1, mini + 1) if mini % k == 0 and k <= micro_rows * num_ranks(args.job))
    if batch % mini:
        _fail(f"batch {batch} and mini batch {mini} do not divide")
    opt_per_rollout = a.ppo_epochs * (batch // mini)

    trl_logs: list[dict] = []

    class Logs(TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs:
                trl_logs.append(dict(logs))

    class Clock(TrainerCallback):
        """Wall time of each rollout step: generation + scoring + its opt_per_rollout optimizer steps."""

        marks: list[float] = []

        def on_train_begin(self, *_, **__):
            self.marks.append(time.perf_counter())

        def on_step_end(self, _args, state, *_, **__):
            if state.global_step % opt_per_rollout == 0:
                self.marks.append(time.perf_counter())

    max_completion, tool_args = r.max_new_tokens, {}
    if tools:  # per model turn as in verl-ds; the whole completion (model + tool tokens) as verl-ds's row bound
        max_completion = mt.max_total_tokens or (r.max_model_len - longest)
        tool_args = dict(
            max_tool_calling_iterations=mt.max_turns - 1, generation_kwargs={"max_new_tokens": r.max_new_tokens}
        )
    gargs = GRPOConfig(
        output_dir=str(out_dir / "trl"),
        use_cpu=not torch.cuda.is_available(),
        seed=t.seed,
        data_seed=t.seed,
        max_steps=t.steps * opt_per_rollout,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=mini // per_device,
        steps_per_generation=batch // per_device,
        num_generations=r.n,
        num_iterations=a.ppo_epochs,
        max_completion_length=max_completion,
        **tool_args,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=0,
        learning_rate=actor.lr,
        weight_decay=actor.weight_decay,
        adam_beta1=actor.betas[0],
        adam_beta2=actor.betas[1],
        adam_epsilon=1e-8,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=t.max_grad_norm,
        beta=a.kl_coef if a.use_kl_loss else 0.0,
        use_bias_correction_kl=False,
        epsilon=a.clip_low,
        epsilon_high=a.clip_high,
        loss_type="dapo",
        scale_rewards="group",
        mask_truncated_completions=a.mask_truncated,
        entropy_coef=a.entropy_coef,
        gradient_checkpointing=p.enable_grad_checkpointing,
        bf16=False,
        fp16=False,
        model_init_kwargs={"dtype": torch.float32},
        use_vllm=False,
        logging_steps=opt_per_rollout,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=reward,
        args=gargs,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock(), Logs()],
        **({"tools": trl_tool_fns} if tools else {}),
    )
    if tools:  # the ids after a tool call: TRL's must be verl-ds's observation ids
        if trainer.chat_template is not None:
            _fail("TRL replaced the chat template (not prefix-preserving): the prompts would differ")
        obs = [{"role": "tool", "name": tools[0].__name__, "content": "35"}]
        if trainer._get_tool_suffix_ids(obs) != obs_ids:
            _fail("TRL's tool-result ids differ from verl-ds's ChatCodec.observation_ids")
    trainer.train()
    trainer.save_model(str(out_dir / "final_model"))

    step_s = [b - e for e, b in zip(Clock.marks, Clock.marks[1:])]
    result = {
        "side": "trl",
        "job": args.job,
        "steps": len(step_s),
        "s_per_step": statistics.median(step_s[1:]) if len(step_s) > 1 else (step_s or [None])[0],
        "first_step_s": step_s[0] if step_s else None,
        "reward_first5": statistics.mean(step_rewards[:5]) if step_rewards else None,
        "reward_last10": statistics.mean(step_rewards[-10:]) if step_rewards else None,
        "threads": torch.get_num_threads(),
        "trl_out": str(out_dir) if args.out_dir else None,
    }
    result["episodes_per_step"] = batch
    result["episodes_per_s"] = batch / result["s_per_step"] if result["s_per_step"] else None
    if tools:
        calls, fails, turns, eps = (sum(x[k] for x in tool_counts) for k in range(4))
        trl_freq = [x["tools/call_frequency"] for x in trl_logs if "tools/call_frequency" in x]
        result.update(
            {
                "tool_calls_per_episode": calls / eps if eps else None,
                "tool_calls_per_turn": calls / turns if turns else None,  # verl-ds's tools/call_frequency
                "tool_failures_per_call": fails / calls if calls else None,
                "turns_per_episode": turns / eps if eps else None,
                "tool_calls_per_episode_steps": [x[0] / x[3] for x in tool_counts],
                "trl_tools_call_frequency": trl_freq,  # TRL's own: calls per episode
                "completion_mean_length": _mean_or_none(
                    [x["completions/mean_length"] for x in trl_logs if "completions/mean_length" in x]
                ),
            }
        )
    if tmp is not None:
        tmp.cleanup()
    result["wall_s"] = time.time() - T_START
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
