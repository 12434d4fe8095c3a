"""TRL's GRPOTrainer on a verl-ds job, for the side-by-side table (benchmarks/side_by_side.py).

Runs INSIDE benchmarks/.venv-trl (bash benchmarks/setup_trl.sh), never in the project's .venv:
    benchmarks/.venv-trl/bin/python benchmarks/trl_grpo.py --job quickstart [--steps 10] [key=value ...]
Prints one JSON line last: {"job", "steps", "s_per_step", "wall_s", "reward_first5", "reward_last10", ...}.

The job is read from the same YAML verl-ds trains on (verl_ds.config.load_config, with the same
overrides), so both sides share one source of truth: the tiny model (verl_ds.data.tiny, same seed, so
the same initial weights), the prompts (verl_ds.data.dataset.load_examples: the same train split) and
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

Differences that remain (TRL cannot express them, or they are how TRL works):
  - generation: TRL here uses plain transformers `generate` (no vLLM in this venv). verl-ds follows
    the yaml: the quickstart's `rollout.engine: auto` picks HF `generate` for its 330k model on CPU,
    SmolLM2's yaml uses vLLM (synced in place every step); job quickstart_vllm forces vLLM on the
    quickstart.
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
_COMMON = ["trainer.val_every=0", "trainer.val_before_train=false", "logging.memory_every=0",
           "logging.wandb.mode=disabled", "checkpoint.every=0", "precision.actor_dtype=fp32",
           "precision.reference_dtype=fp32", "precision.rollout_dtype=fp32"]
JOBS = {
    "quickstart": ("examples/grpo_cpu_tiny.yaml", _COMMON, 120, 2),
    # the same job with verl-ds sampling through vLLM instead of the example's auto -> HF `generate`:
    # what vLLM's import, engine start and per-request overhead cost on a 330k-parameter model
    "quickstart_vllm": ("examples/grpo_cpu_tiny.yaml", _COMMON + ["rollout.engine=vllm"], 120, 2),
    # one rank takes the 16 rows per micro-batch that two ranks of 8 took (TRL's per-device batch: 16 either way)
    "smollm2": ("examples/grpo_cpu_smollm2.yaml", _COMMON + ["roles.actor.micro_batch_size=16",
                                                             "roles.reference.micro_batch_size=16"], 4, 1),
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", choices=sorted(JOBS), required=True)
    ap.add_argument("--steps", type=int, default=None, help="rollout steps (default: the job's)")
    ap.add_argument("--out-dir", default=None, help="TRL output dir, kept (default: a temporary one, removed)")
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

    from verl_ds.data.dataset import load_examples
    from verl_ds.data.reward import get_reward_fn
    from verl_ds.data.tiny import build_char_tokenizer, build_tiny_llama, load_tokenizer

    a, r, d, t, actor = cfg.algorithm, cfg.rollout, cfg.data, cfg.trainer, cfg.roles.actor
    p = cfg.precision
    if a.estimator != "grpo" or a.kl_estimator not in ("k3", "low_var_kl") or (a.kl_coef and not a.use_kl_loss):
        _fail("only estimator grpo with a k3 KL loss maps onto TRL's GRPOTrainer")
    if {p.actor_dtype, p.reference_dtype, p.rollout_dtype} != {"fp32"}:
        _fail("this comparison is fp32 only: pass precision.{actor,reference,rollout}_dtype=fp32")
    if a.loss_agg_mode != "token-mean" or a.policy_loss != "vanilla" or a.reward_normalization != "none":
        _fail("only loss_agg_mode token-mean, policy_loss vanilla, reward_normalization none map onto TRL here")

    tmp = None if args.out_dir else tempfile.TemporaryDirectory(prefix="trl_grpo_")
    out_dir = Path(args.out_dir or tmp.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.model.path == "tiny":          # the same random init verl-ds builds in its run dir
        m = cfg.model.tiny
        model_path = str(build_tiny_llama(out_dir / "init_model", build_char_tokenizer(), hidden=m.hidden,
                                          layers=m.layers, heads=m.heads, ffn=m.ffn, seed=m.seed))
    else:
        model_path = str(ROOT / cfg.model.path) if not Path(cfg.model.path).is_absolute() else cfg.model.path
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or model_path)   # keeps the char pre-tokenizer

    train, _val = load_examples(d)
    if d.apply_chat_template:
        rows = [{"prompt": [{"role": "user", "content": e["prompt"]}], "answer": e["answer"]} for e in train]
        longest = max(len(tokenizer.apply_chat_template(x["prompt"], add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"]) for x in rows[:256])
    else:
        rows = [{"prompt": e["prompt"], "answer": e["answer"]} for e in train]
        longest = max(len(tokenizer(x["prompt"])["input_ids"]) for x in rows[:256])
    if longest > d.max_prompt_length:
        _fail(f"prompts of {longest} tokens > data.max_prompt_length {d.max_prompt_length} (TRL would not cut them)")
    dataset = Dataset.from_list(rows)

    score = get_reward_fn(d.reward_fn)
    step_rewards: list[float] = []       # mean reward of each rollout batch (one reward call per generation)

    def reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        out = [float(score(x, ans)) for x, ans in zip(texts, answer)]
        step_rewards.append(sum(out) / len(out))
        return out
    reward.__name__ = d.reward_fn

    batch = t.prompts_per_step * r.n
    mini = t.mini_batch_size or batch
    micro_rows = actor.micro_batch_size
    if actor.max_tokens_per_micro_batch:      # verl-ds's token budget: as many padded rows as fit
        micro_rows = max(1, actor.max_tokens_per_micro_batch // (longest + r.max_new_tokens))
    per_device = max(k for k in range(1, mini + 1) if mini % k == 0 and k <= micro_rows * num_ranks(args.job))
    if batch % mini:
        _fail(f"batch {batch} and mini batch {mini} do not divide")
    opt_per_rollout = a.ppo_epochs * (batch // mini)

    class Clock(TrainerCallback):
        """Wall time of each rollout step: generation + scoring + its opt_per_rollout optimizer steps."""
        marks: list[float] = []

        def on_train_begin(self, *_, **__):
            self.marks.append(time.perf_counter())

        def on_step_end(self, _args, state, *_, **__):
            if state.global_step % opt_per_rollout == 0:
                self.marks.append(time.perf_counter())

    gargs = GRPOConfig(
        output_dir=str(out_dir / "trl"), use_cpu=not torch.cuda.is_available(), seed=t.seed, data_seed=t.seed,
        max_steps=t.steps * opt_per_rollout, per_device_train_batch_size=per_device,
        gradient_accumulation_steps=mini // per_device, steps_per_generation=batch // per_device,
        num_generations=r.n, num_iterations=a.ppo_epochs, max_completion_length=r.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, top_k=0,
        learning_rate=actor.lr, weight_decay=actor.weight_decay, adam_beta1=actor.betas[0],
        adam_beta2=actor.betas[1], adam_epsilon=1e-8, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=t.max_grad_norm, beta=a.kl_coef if a.use_kl_loss else 0.0,
        use_bias_correction_kl=False, epsilon=a.clip_low, epsilon_high=a.clip_high, loss_type="dapo",
        scale_rewards="group", mask_truncated_completions=a.mask_truncated, entropy_coef=a.entropy_coef,
        gradient_checkpointing=p.enable_grad_checkpointing, bf16=False, fp16=False,
        model_init_kwargs={"dtype": torch.float32}, use_vllm=False,
        logging_steps=opt_per_rollout, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=gargs, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    trainer.save_model(str(out_dir / "final_model"))

    step_s = [b - e for e, b in zip(Clock.marks, Clock.marks[1:])]
    result = {
        "side": "trl", "job": args.job, "steps": len(step_s),
        "s_per_step": statistics.median(step_s[1:]) if len(step_s) > 1 else (step_s or [None])[0],
        "first_step_s": step_s[0] if step_s else None,
        "reward_first5": statistics.mean(step_rewards[:5]) if step_rewards else None,
        "reward_last10": statistics.mean(step_rewards[-10:]) if step_rewards else None,
        "threads": torch.get_num_threads(), "trl_out": str(out_dir) if args.out_dir else None,
    }
    if tmp is not None:
        tmp.cleanup()
    result["wall_s"] = time.time() - T_START
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
