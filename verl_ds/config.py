"""The YAML run config as typed dataclasses, with dotted overrides and validation.

`load_config(path, overrides)` is the one entry point. Every user mistake raises `ConfigError`
naming the key or file; the CLI turns it into one line and exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from verl_ds.algos import (
    ADVANTAGE_ESTIMATORS,
    AGG_LOSS_MODES,
    ESTIMATORS_NEEDING_CRITIC,
    GROUP_ESTIMATORS,
    KL_KINDS,
    POLICY_LOSSES,
)
from verl_ds.data.reward import task_reward_fn
from verl_ds.envs import import_object, load_env_factory, load_tools
from verl_ds.errors import ConfigError, broken, raise_all
from verl_ds.precision import INT8_ROLES, TRAINED_ROLES, PrecisionConfig
from verl_ds.rollout.engines.weights import safetensors_damage
from verl_ds.rollout.episodes import Sampling
from verl_ds.schema import field_errors, markdown, opt, section

REPO_ROOT = Path(__file__).resolve().parent.parent
DS_CONFIG_DIR = REPO_ROOT / "ds_configs"


def resolve_ds_path(name: str) -> Path:
    p = Path(name)
    if p.is_absolute() or p.exists():
        return p
    return DS_CONFIG_DIR / name


def read_ds_json(name: str, key: str) -> dict:
    path = resolve_ds_path(name)
    if not name:
        raise ConfigError(key, "no DeepSpeed JSON file given")
    if not path.is_file():
        raise ConfigError(key, f"DeepSpeed config file not found: {path}")
    return read_json_object(path, "a DeepSpeed config")


def read_ds_files(cfg: RunConfig) -> dict[str, dict]:
    """Each active role's DeepSpeed JSON file, as written (read once by a run: `trainer/setup.py`)."""
    return {r: read_ds_json(getattr(cfg.roles, r).ds_config, f"roles.{r}.ds_config") for r in active_roles(cfg)}


def read_json_object(path: Path, what: str) -> dict:
    """A JSON file that must hold one object (a DeepSpeed config, an HF config.json): anything else
    (not UTF-8, e.g. a weights file given by mistake; malformed; a key given twice) is one line."""
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text, object_pairs_hook=_unique_keys(str(path), text))
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), f"not UTF-8 text (byte {e.start}): is it {what}?") from None
    except json.JSONDecodeError as e:
        raise ConfigError(str(path), f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"{what} must be a JSON object")
    return data


def _unique_keys(where: str, text: str):
    """A `json.loads` object hook that refuses a key given twice in one object (JSON keeps the last,
    silently), naming the key and the lines where it stands."""

    def hook(pairs: list) -> dict:
        seen = set()
        for k, _ in pairs:
            if k in seen:
                lines = [i + 1 for i, line in enumerate(text.splitlines()) if f'"{k}"' in line]
                at = f" (lines {', '.join(map(str, lines))})" if len(lines) > 1 else ""
                raise ConfigError(
                    where, f"key '{k}' is given twice in one object{at}: the second would replace the first"
                )
            seen.add(k)
        return dict(pairs)

    return hook


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last, silently:
    a second `trainer:` section would drop the first's settings without a word). `read_yaml` adds
    the file to the ConfigError's `:line`."""

    def construct_mapping(self, node, deep=False):
        first: dict = {}
        for key_node, _ in node.value:
            key, line = self.construct_object(key_node, deep=deep), key_node.start_mark.line + 1
            if key in first:
                raise ConfigError(
                    f":{line}",
                    f"key '{key}' is given twice (lines {first[key]} and {line}): the second would replace the first",
                )
            first[key] = line
        return super().construct_mapping(node, deep=deep)


# ---------------------------------------------------------------- the schema
# Every key's type, default, help and allowed values stand at its field (`schema.opt`): the
# loader, `validate` and docs/CONFIG.md (`verl-ds config docs`) read them from here.


@dataclass
class TinyModelConfig:
    """Used when `model.path: tiny`: a random-init char-level Llama is built in the run dir."""

    tokenizer: str = opt(
        "char",
        "char: digits and operators, no chat template | chat: printable ASCII with a ChatML template (agents)",
        choices=("char", "chat"),
    )
    hidden: int = opt(128, "hidden size", gt=0)
    layers: int = opt(2, "decoder layers", gt=0)
    heads: int = opt(4, "attention heads (must divide hidden)", gt=0)
    ffn: int = opt(256, "MLP width", gt=0)
    seed: int = opt(0, "initialisation seed")
    max_positions: int = opt(256, "the longest row it takes (max_position_embeddings)", gt=0)


@dataclass
class LoraConfig:
    """A LoRA actor (peft): rank 0 = off. The reference is the base with adapters disabled."""

    rank: int = opt(0, "adapter rank; 0: no LoRA (full fine-tuning)", ge=0)
    alpha: float = opt(16.0, "LoRA scaling numerator (scale = alpha / rank)", gt=0)
    dropout: float = opt(0.0, "dropout on the adapter input", ge=0, lt=1)
    target_modules: list = opt(
        help="module names that get adapters",
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    modules_to_save: list = opt(help="modules trained in full besides the adapters (e.g. a norm)", factory=list)


@dataclass
class ModelConfig:
    """The policy model and the optional critic / reward model directories."""

    path: str = opt("tiny", "an HF model directory, or `tiny` (a random char-level Llama built in the run dir)")
    tokenizer_path: Optional[str] = opt(None, "tokenizer directory; null: `path`")
    trust_remote_code: bool = opt(False, "run the model directory's own Python code (only when you trust it)")
    critic_path: Optional[str] = opt(None, "the critic's initial weights; null: the actor's backbone + a value head")
    reward_path: Optional[str] = opt(None, "an HF sequence classifier scoring responses; null: data.reward_fn alone")
    teacher_path: Optional[str] = opt(
        None,
        "on-policy distillation: a frozen HF causal LM (its tokenizer must equal the student's) that scores the "
        "student's samples (algorithm.distill); null: no teacher",
    )
    tiny: TinyModelConfig = section(TinyModelConfig)
    lora: LoraConfig = section(LoraConfig)
    share_prompt: bool = opt(
        True,
        "shared prefixes: in every role's passes (actor update and old logprobs, reference, teacher, critic, "
        "reward model) the rows of a micro-batch that share a prefix (a prompt's n samples, multi-turn episodes "
        "forked after their first turns) run it once, each row its own tokens against it, under one mask "
        "(exact; with gradient checkpointing, token budgets, LoRA and ZeRO 0-3). Off under sequence "
        "parallelism and with flash_attention_2 (varlen kernels cannot take the mask: sdpa or flex_attention)",
    )
    share_prefix_min_tokens: Any = opt(
        "auto",
        "a micro-batch shares its prefixes only where that saves at least this many tokens a row (and a FLOP "
        "count of its projections and attention says the shared pass is cheaper): below, the plain pass. auto: "
        "6 with an fp32 actor (a 2-layer 128-wide model's update breaks even at ~7, SmolLM2-135M gains from 7: "
        "benchmarks/shared_prefix_threshold.py), 16 with a 16-bit one (short prompts keep the plain pass, whose "
        "kernels match the rollout engine's: a matched 16-bit pair stays exact there; the shared pass rounds "
        "differently, ~2e-3 in bf16)",
        ge=0,
        auto=True,
    )
    attn_implementation: str = opt(
        "auto",
        "the policy models' attention in training (actor, reference, teacher): auto: flash_attention_2 on a GPU "
        "with the flash-attn package installed, sdpa on other GPUs, sdpa_cpu16 on CPU (SDPA, except 16-bit passes "
        "under grad, which run the plain attention math: CPU's fused 16-bit SDPA backward is slower)",
        choices=("auto", "sdpa", "sdpa_cpu16", "eager", "flash_attention_2", "flex_attention"),
    )
    packing: Any = opt(
        "auto",
        "padding-free rows in the policy models' passes: a micro-batch's rows run as one sequence, positions "
        "restarting per row and attention kept inside each row (exact); auto: on with flash_attention_2 (varlen "
        "attention runs no padding), off elsewhere (on CPU SDPA's masked pack measured slower than token budgets)",
        choices=("auto", True, False),
    )

    def check(self) -> list[ConfigError]:
        """The rules within this section that its fields' bounds cannot state."""
        return broken(
            (
                self.lora.rank > 0 and not self.lora.target_modules,
                "model.lora.target_modules",
                "a LoRA actor needs at least one target module",
            ),
        )


@dataclass
class ArithmeticConfig:
    """`data.task: arithmetic`: generated `a+b=` prompts."""

    min_value: int = opt(0, "smallest operand")
    max_value: int = opt(4, "largest operand")
    num_operands: int = opt(2, "operands per prompt", gt=0)
    ops: str = opt("+", "operators to draw from, e.g. `+-*`")
    size: int = opt(10000, "prompts generated", gt=0)


@dataclass
class ReasoningGymConfig:
    """`data.task: reasoning_gym`: a generator of the reasoning-gym package (offline)."""

    name: str = opt("basic_arithmetic", "the reasoning-gym dataset name")
    size: int = opt(2000, "training questions", gt=0)
    seed: int = opt(0, "generator seed of the training questions")
    val_size: int = opt(64, "validation questions (another seed; questions seen in training removed)", ge=0)
    val_seed: int = opt(100003, "generator seed of the validation questions")
    config: dict = opt(help="the generator's own options", factory=dict)
    reward_threshold: Optional[float] = opt(None, "partial credit -> 1 if >= threshold else 0; null: as scored")


@dataclass
class DataConfig:
    """Prompts, answers, the rule reward and how prompts are rendered."""

    task: str = opt("arithmetic", "where prompts come from", choices=("arithmetic", "files", "reasoning_gym"))
    train_files: list = opt(help="jsonl or parquet files (task: files)", factory=list)
    val_files: list = opt(help="held-out prompts, same keys (task: files)", factory=list)
    val_fraction: float = opt(0.0, "built-in tasks: distinct prompts held out for validation", ge=0, lt=1)
    prompt_key: str = opt("prompt", "the prompt's key in a data file")
    answer_key: str = opt("answer", "the answer's key in a data file")
    reward_fn: str = opt(
        "arithmetic",
        "the rule reward: arithmetic, gsm8k, last_number, math_verify, reasoning_gym, a dotted path "
        "`module:function` (importable), or `none` (the environment's reward alone)",
    )
    apply_chat_template: bool = opt(False, "render prompts with the tokenizer's chat template")
    system_prompt: Optional[str] = opt(None, "a system message before every prompt (chat template only)")
    few_shot: list = opt(help="chat messages ({role, content}) between the system prompt and each prompt", factory=list)
    tools: list = opt(
        help="tools for rollout.multi_turn.env: tools: `calculator` or `pkg.module:function`", factory=list
    )
    max_prompt_length: int = opt(64, "prompt tokens at most (longer prompts are cut from the left)", gt=0)
    shuffle: bool = opt(True, "shuffle the training prompts each epoch")
    seed: int = opt(0, "seed of the shuffle and of the validation split")
    arithmetic: ArithmeticConfig = section(ArithmeticConfig)
    reasoning_gym: ReasoningGymConfig = section(ReasoningGymConfig)

    def check(self) -> list[ConfigError]:
        """The rules within this section that its fields' bounds cannot state."""
        return broken(
            (
                bool(self.val_files) and self.task != "files",
                "data.val_files",
                "validation files go with task 'files' (the built-in task uses data.val_fraction)",
            ),
            (
                self.task == "files" and not self.train_files,
                "data.train_files",
                "task 'files' needs at least one jsonl or parquet file",
            ),
            (
                self.system_prompt is not None and not self.apply_chat_template,
                "data.system_prompt",
                "a system prompt needs data.apply_chat_template: true",
            ),
            (
                bool(self.few_shot) and not self.apply_chat_template,
                "data.few_shot",
                "few-shot chat messages need data.apply_chat_template: true",
            ),
            *(
                (
                    not (
                        isinstance(m, dict)
                        and set(m) == {"role", "content"}
                        and all(isinstance(v, str) for v in m.values())
                    ),
                    f"data.few_shot[{i}]",
                    f"expected {{role: ..., content: ...}} (strings), got {m!r}",
                )
                for i, m in enumerate(self.few_shot)
            ),
        )


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose samples all scored alike, sample more prompts."""

    enabled: bool = opt(False, "filter groups by reward variance")
    metric: str = opt("acc", "acc: the rule reward as returned; score: after shaping", choices=("acc", "score"))
    max_rounds: int = opt(4, "generation rounds per step at most", gt=0)


@dataclass
class OverlongConfig:
    """DAPO soft overlong punishment: linear penalty over the last `buffer_len` tokens."""

    buffer_len: int = opt(0, "tokens before rollout.max_new_tokens where the penalty ramps up; 0: off", ge=0)
    penalty: float = opt(1.0, "the penalty at max_new_tokens", ge=0)


@dataclass
class DistillConfig:
    """On-policy distillation from `model.teacher_path`: the student samples, the frozen teacher scores
    the same tokens, and the per-token reverse KL log pi_student - log pi_teacher drives the student."""

    coef: float = opt(0.0, "weight of the distillation signal; 0: off (needs model.teacher_path when > 0)", ge=0)
    mode: str = opt(
        "reward",
        "reward: -coef * reverse KL per token as a dense reward (advantage = its discounted sum) | "
        "loss: coef * the reverse-KL estimator (kl_estimator) as a term of the actor's loss",
        choices=("reward", "loss"),
    )
    discount: float = opt(0.0, "reward mode: discount of the per-token rewards; 0: each token its own", ge=0, le=1)
    kl_estimator: str = opt(
        "k2",
        "loss mode: the estimator whose gradient on the student's own samples is taken; k2: the reverse KL's "
        "(k1: zero in expectation; k3: the forward KL's)",
        choices=KL_KINDS,
    )
    with_task_reward: bool = opt(
        False, "also train on the task reward (the estimator's advantages); false: distillation alone"
    )


@dataclass
class AlgorithmConfig:
    """The advantage estimator, the policy loss and the KL term."""

    estimator: str = opt("grpo", "advantage estimator (gae needs a critic)", choices=ADVANTAGE_ESTIMATORS)
    gamma: float = opt(1.0, "discount (gae, reinforce_pp)", ge=0, le=1)
    lam: float = opt(1.0, "GAE lambda", ge=0, le=1)
    ppo_epochs: int = opt(1, "passes over each rollout batch", gt=0)
    clip_low: float = opt(0.2, "PPO ratio clip below 1", ge=0)
    clip_high: float = opt(0.2, "PPO ratio clip above 1 (DAPO's clip-higher: > clip_low)", ge=0)
    dual_clip_c: Optional[float] = opt(None, "dual-clip PPO's bound on negative-advantage ratios (> 1); null: off")
    loss_agg_mode: str = opt("token-mean", "how token losses become one number", choices=AGG_LOSS_MODES)
    entropy_coef: float = opt(0.0, "entropy bonus coefficient")
    vf_clip: Optional[float] = opt(0.5, "value clipping range; null: no value clipping", gt=0)
    vf_coef: float = opt(1.0, "value loss coefficient", ge=0)
    kl_estimator: str = opt("k3", "KL estimator against the reference", choices=KL_KINDS)
    use_kl_loss: bool = opt(True, "KL as a loss term (GRPO style); false: in the reward")
    kl_coef: float = opt(0.04, "KL coefficient; 0: no reference model", ge=0)
    kl_target: Optional[float] = opt(None, "adaptive KL controller's target (in-reward KL); null: fixed kl_coef", gt=0)
    kl_horizon: int = opt(10000, "adaptive KL controller's horizon", gt=0)
    reward_normalization: str = opt("none", "normalise scores", choices=("none", "batch", "running"))
    reward_clip: Optional[float] = opt(None, "clip scores to [-c, c] after normalisation; null: off", gt=0)
    tis_cap: Optional[float] = opt(
        None, "importance weights against the rollout (behaviour) policy, capped; null: off", gt=0
    )
    tis_mode: str = opt(
        "truncate",
        "a weight above tis_cap: truncate (TIS: min(w, cap)) | mask (AReaL's decoupled PPO: the token drops out)",
        choices=("truncate", "mask"),
    )
    policy_loss: str = opt("vanilla", "vanilla (PPO clip) | gspo (sequence ratio) | cispo", choices=POLICY_LOSSES)
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig)
    overlong: OverlongConfig = section(OverlongConfig)
    distill: DistillConfig = section(DistillConfig)
    mask_truncated: bool = opt(False, "samples cut at max_new_tokens contribute no loss")
    mismatch_gate: str = opt(
        "warn",
        "the rollout-vs-trainer share of tokens outside the clip band on the same weights, past "
        "mismatch_gate_fraction: warn (one line) | stop (the run ends, one line) | off",
        choices=("off", "warn", "stop"),
    )
    mismatch_gate_fraction: Optional[float] = opt(
        None, "the gate's bound on that share; null: from the trainer/rollout dtypes (GUIDE)", gt=0, le=1
    )

    def check(self) -> list[ConfigError]:
        """The rules within this section that its fields' bounds cannot state."""
        return broken(
            (
                self.dual_clip_c is not None and self.dual_clip_c <= 1,
                "algorithm.dual_clip_c",
                f"must be > 1, got {self.dual_clip_c}",
            ),
            (
                self.dual_clip_c is not None and self.policy_loss != "vanilla",
                "algorithm.dual_clip_c",
                f"dual clip applies to the vanilla PPO loss only, not '{self.policy_loss}'",
            ),
            (
                self.kl_target is not None and self.use_kl_loss,
                "algorithm.kl_target",
                "the adaptive KL controller acts on the in-reward KL; set algorithm.use_kl_loss: false or drop "
                "kl_target",
            ),
            (
                self.distill.coef > 0 and self.estimator in ESTIMATORS_NEEDING_CRITIC,
                "algorithm.distill.coef",
                f"distillation pairs with critic-free estimators (grpo, rloo, ...), not '{self.estimator}'",
            ),
        )


@dataclass
class MultiTurnConfig:
    """Multi-turn episodes (agents, tools, environments); see docs/ENVIRONMENTS.md. Neither `env` nor
    `agent`: every episode is one turn (a single-turn job)."""

    env: str = opt("", "tools | retry | pkg.module:Class (importable from PYTHONPATH); empty: single-turn")
    agent: str = opt(
        "",
        "your OpenAI-client agent as it is, `pkg.module:function`: `async def fn(client: openai.AsyncOpenAI, "
        "example: dict) -> float` (the reward), run rollout.n times per prompt against this rank's token-recording "
        "endpoint; needs data.apply_chat_template; instead of env",
    )
    agent_timeout_s: float = opt(
        300.0, "an agent episode running longer ends with reward 0, counted in agent/failures", gt=0
    )
    env_kwargs: dict = opt(help="keyword arguments of the environment's constructor", factory=dict)
    max_turns: int = opt(4, "model turns per episode at most", gt=0)
    max_env_tokens: int = opt(0, "an observation's content is cut to this many tokens; 0: no cut", ge=0)
    max_total_tokens: int = opt(0, "model + environment tokens per row; 0: rollout.max_model_len bounds it", ge=0)
    max_env_failure_fraction: float = opt(
        0.1,
        "an exception raised inside the environment ends its episode (counted in env/failures, its traceback "
        "logged); the run stops when more than this fraction of a step's episodes end so",
        ge=0,
        le=1,
    )
    max_agent_failure_fraction: float = opt(
        0.5,
        "an agent that raises or times out ends its episode with reward 0 (counted in agent/failures, one console "
        "line a step, tracebacks at logging.level DEBUG); the run stops when more than this fraction of a step's "
        "agent episodes end so",
        ge=0,
        le=1,
    )
    tokenization_check: str = opt(
        "strict", "strict: compare each episode's ids with a one-shot render (a metric)", choices=("strict", "off")
    )

    @property
    def enabled(self) -> bool:
        """Episodes of several turns: an environment's, or an agent's."""
        return bool(self.env or self.agent)


@dataclass
class PartialConfig:
    """Partial rollouts: a step trains the groups that finish first; the rest go on, on new weights.

    Instead of every step waiting for its slowest episode (docs/PARTIAL_ROLLOUTS.md)."""

    enabled: bool = opt(False, "keep unfinished episodes in flight across steps (agents: one engine per rank)")
    max_staleness: int = opt(
        1,
        "a group admitted at weights version v trains at version v + max_staleness at the latest (admission "
        "control: nothing is dropped); 0: the synchronous step exactly",
        ge=0,
    )
    over_provision: float = opt(
        1.0, "groups in flight per rank, beyond the step's own, as a fraction of them (also <= max_staleness)", ge=0
    )
    chunk_tokens: int = opt(
        0,
        "HF generate and tensor-parallel groups: new tokens per episode per round, a step stopping between rounds "
        "(vLLM on one rank stops between any two engine steps); 0: max_new_tokens / 4",
        ge=0,
    )
    tail_fraction: float = opt(
        0.1,
        "a step cuts its running episodes once it can train and they have fallen to this fraction of the most "
        "it ran (its tail); 1.0: the moment it can train (more cut episodes to re-send)",
        gt=0,
        le=1,
    )


@dataclass
class RolloutConfig:
    """Sampling: the engine, the sampling parameters and vLLM's memory."""

    engine: str = opt(
        "vllm", "vllm | hf | auto (CPU: HF generate for models under 2M parameters)", choices=("vllm", "hf", "auto")
    )
    n: int = opt(8, "samples per prompt", gt=0)
    temperature: float = opt(1.0, "sampling temperature; the trainer scores with the same", gt=0)
    top_p: float = opt(
        1.0,
        "nucleus sampling; < 1: every pass (update, old, reference, teacher) scores a token under the "
        "renormalised set the rollout sampled it from, recomputed from the trainer's logits by the engine's rule",
        gt=0,
        le=1,
    )
    top_k: int = opt(0, "sample from the k most likely tokens (0: all); scored as top_p is", ge=0)
    max_new_tokens: int = opt(8, "response tokens at most (multi-turn: per model turn)", gt=0)
    tensor_parallel_size: int = opt(1, "ranks that share one vLLM engine; must divide the world size", gt=0)
    enforce_eager: Any = opt(
        "auto",
        "vLLM without CUDA graphs / torch.compile; auto: compiled with CUDA graphs on a GPU (vLLM's default), "
        "eager on CPU (compiling costs a minute at start, then 20 s a start from its cache, for ~0.8x the "
        "generation time: set false for long CPU runs)",
        choices=("auto", True, False),
    )
    max_model_len: int = opt(256, "vLLM's context length (prompt + response)", gt=0)
    kv_cache_gb: float = opt(0.25, "CPU: the KV cache size in GiB (GPU: gpu_memory_utilization)", gt=0)
    block_size: int = opt(0, "KV-cache block in tokens (a multiple of 32); 0: vLLM's (CPU 128)", ge=0)
    bucket_mb: int = opt(256, "weight-sync bucket size in MiB (bounds the extra memory of a sync)", gt=0)
    gpu_memory_utilization: float = opt(0.5, "GPU: the fraction of device memory vLLM may take", gt=0, le=1)
    sleep: bool = opt(
        True,
        "GPU: free vLLM's KV cache and weights while the roles train (the weights are discarded after a step's "
        "generation, the sync loads new ones; the KV cache comes back only to generate)",
    )
    multi_turn: MultiTurnConfig = section(MultiTurnConfig)
    partial: PartialConfig = section(PartialConfig)

    @property
    def sampling(self) -> Sampling:
        """How a step's prompts are sampled (`n` each, these parameters): the loop's, a partial-rollout pool's
        and a rollout rank's, one place."""
        return Sampling(self.n, self.temperature, self.top_p, self.max_new_tokens, self.top_k)

    def check(self) -> list[ConfigError]:
        """The rules within this section that its fields' bounds cannot state."""
        mt, pr = self.multi_turn, self.partial
        return broken(
            (
                self.block_size % 32 != 0,
                "rollout.block_size",
                f"must be 0 (vLLM's default) or a multiple of 32, got {self.block_size}",
            ),
            (
                bool(mt.env) and bool(mt.agent),
                "rollout.multi_turn.agent",
                "an agent runs its own episodes: set rollout.multi_turn.env or .agent, not both",
            ),
            (
                pr.enabled and bool(mt.agent) and self.tensor_parallel_size > 1,
                "rollout.partial.enabled",
                "partial rollouts of agent episodes run one engine per rank: set rollout.tensor_parallel_size: 1",
            ),
        )


OFFLOADS = ("none", "optimizer", "params", "optimizer+params")


@dataclass
class RoleConfig:
    """One role's DeepSpeed engine: its JSON file, optimizer and batch."""

    ds_config: str = opt("", "a DeepSpeed JSON file (relative: to ds_configs/)")
    lr: float = opt(1e-6, "learning rate (trained roles; 0 freezes the weights)", ge=0)
    weight_decay: float = opt(0.0, "AdamW weight decay", ge=0)
    betas: list = opt(help="AdamW betas", factory=lambda: [0.9, 0.999])
    micro_batch_size: int = opt(
        8, "rows per micro-batch per rank (under trainer.sequence_parallel_size > 1: one)", gt=0
    )
    max_tokens_per_micro_batch: Any = opt(
        "auto",
        "padded tokens per micro-batch, rows packed by length so little padding runs (dynamic size); auto: "
        "micro_batch_size x the longest row the run can make (`token_budget`: never more than a row micro-batch "
        "of full-length rows); 0: micro_batch_size rows each",
        ge=0,
        auto=True,
    )
    zero_stage: Any = opt(
        None,
        "null: the JSON's | 0-3 | auto: the lowest stage that fits (GPU memory)",
        choices=(None, "auto", 0, 1, 2, 3),
    )
    offload: str = opt(
        "none",
        "ZeRO-Offload to host memory: optimizer (fp32 masters + Adam states, DeepSpeedCPUAdam; ZeRO >= 1) | "
        "params (the weights; ZeRO-3) | optimizer+params | none",
        choices=OFFLOADS,
    )
    sleep: bool = opt(
        False,
        "GPU: move this trained role's optimizer states, fp32 masters, gradients and weights to host memory from "
        "the weight sync until the next generation ends (ZeRO >= 1); CPU: a no-op",
    )
    tiled_mlp: bool = opt(
        False,
        "long rows: each decoder layer's MLP runs in tiles of `hidden` tokens (DeepSpeed's TiledMLP, ALST), so "
        "its [tokens, ffn] intermediates live one tile at a time; the backward recomputes each tile",
    )
    offload_activations: bool = opt(
        False,
        "GPU, trained roles, with precision.enable_grad_checkpointing: the input each checkpointed layer keeps "
        "waits for the backward in host memory (DeepSpeed's activation-checkpoint offload, ALST); CPU: a no-op",
    )


def offload_stages(offload: str, trained: bool, sleep: bool = False) -> tuple[int, ...]:
    """The ZeRO stages an offload (and `sleep`) setting works at: DeepSpeed offloads optimizer states
    from stage 1 on and parameters at stage 3 only; a frozen role has no optimizer to offload; sleep
    moves the states of a trained role's ZeRO optimizer (stage >= 1), which DeepSpeed refuses when its
    parameters are offloaded."""
    if sleep and (not trained or "params" in offload):
        return ()
    if offload == "none":
        return ((1, 2, 3) if sleep else (0, 1, 2, 3)) if trained else (0, 3)
    if "params" in offload:
        return (3,)
    return (1, 2, 3) if trained else ()


def _role(ds: str, lr: float = 1e-6) -> RoleConfig:
    return RoleConfig(ds_config=ds, lr=lr)


@dataclass
class RolesConfig:
    """The five roles; a run builds only those it needs (`active_roles`)."""

    actor: RoleConfig = opt(help="the policy", factory=lambda: _role("actor_zero3_fp32.json", 5e-4))
    critic: RoleConfig = opt(
        help="the value model (estimator gae)", factory=lambda: _role("critic_zero2_fp32.json", 1e-3)
    )
    reference: RoleConfig = opt(help="the frozen KL reference (kl_coef > 0)", factory=lambda: _role("ref_zero0.json"))
    reward: RoleConfig = opt(help="the reward model (model.reward_path)", factory=lambda: _role("reward_zero0.json"))
    teacher: RoleConfig = opt(
        help="the frozen distillation teacher (model.teacher_path)", factory=lambda: _role("teacher_zero0.json")
    )

    def check(self) -> list[ConfigError]:
        """The rules within this section that its fields' bounds cannot state."""
        betas = self.actor.betas
        return broken((len(betas) != 2, "roles.actor.betas", f"expected two numbers, got {betas!r}"))


@dataclass
class WandbConfig:
    """Weights & Biases."""

    mode: str = opt("offline", "online | offline (synced later) | disabled", choices=("online", "offline", "disabled"))
    project: str = opt("verl-ds", "the W&B project")
    run_name: Optional[str] = opt(None, "the W&B run name; null: W&B's")
    entity: Optional[str] = opt(None, "the W&B entity (team); null: your default")


@dataclass
class LoggingConfig:
    """Metrics, samples and memory accounting."""

    wandb: WandbConfig = section(WandbConfig)
    sample_every: int = opt(10, "a table of generations every K steps; 0: never", ge=0)
    memory_every: int = opt(1, "memory/<stage>/<role>/* every K steps; 0: never", ge=0)
    consistency_every: int = opt(
        10,
        "trainer_corr/*: every K steps a few rows scored again, each alone, against the step's passes; 0: never",
        ge=0,
    )
    level: str = opt("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


@dataclass
class CheckpointConfig:
    """Checkpoints (atomic, resumable) and the final HF export."""

    every: int = opt(0, "a checkpoint every K steps; 0: only at the end", ge=0)
    keep_last: int = opt(2, "checkpoints kept; 0: all", ge=0)
    export_dtype: str = opt("fp32", "dtype of the final HF export of the actor", choices=("fp32", "fp16", "bf16"))
    export: str = opt("merged", "LoRA: merged (an HF model) | adapter (peft format)", choices=("merged", "adapter"))


@dataclass
class TrainerConfig:
    """The loop: steps, batch, seed, run directory, validation."""

    steps: int = opt(100, "rollout steps", gt=0)
    prompts_per_step: int = opt(16, "rollout batch in prompts (x rollout.n samples)", gt=0)
    mini_batch_size: int = opt(0, "samples per optimizer step; 0: the whole rollout batch", ge=0)
    sequence_parallel_size: int = opt(
        1,
        "ranks each row's tokens are split over in every scoring and training pass (DeepSpeed's Ulysses SP, "
        "roles/sequence_parallel.py); 1: off. One per run: DeepSpeed's SP group is process-global, every role "
        "shares it. Every rank still generates its own prompts; a group's ranks then train on their joined rows "
        "(data-parallel ranks: world / SP). It sets what it needs: every role's micro-batch one row without a "
        "token budget (micro_batch_size and max_tokens_per_micro_batch not used), rollout.engine auto -> vllm; "
        "each said at start (and by `config render`)",
        gt=0,
    )
    max_grad_norm: float = opt(1.0, "gradient clipping", gt=0)
    seed: int = opt(1, "the run's seed (sampling, shuffling, dropout)")
    run_dir: str = opt("runs/default", "metrics, checkpoints, samples and the final model go here")
    resume: str = opt("none", "none | auto (the newest checkpoint in run_dir) | a checkpoint directory")
    device: str = opt(
        "auto",
        "the hardware precision `auto` resolves for: auto (CUDA when available) | cpu | cuda (as auto without "
        "one); the engines run where DeepSpeed and vLLM find a GPU: to train on the CPU of a GPU host, hide the "
        "GPUs (CUDA_VISIBLE_DEVICES=)",
        choices=("auto", "cpu", "cuda"),
    )
    rank_memory_gb: Any = opt(
        "auto",
        "memory one rank may use, for the start-up checks and `auto` token budgets and ZeRO stages: auto = its "
        "GPU (less vLLM's share), or on CPU this node's RAM (or its cgroup limit) over the ranks on it",
        gt=0,
        auto=True,
    )
    val_every: int = opt(0, "validate every K steps; 0: never during training", ge=0)
    val_before_train: Optional[bool] = opt(None, "validate before step 1; null: yes when a validation set exists")
    val_n: int = opt(4, "samples per validation prompt (mean@k, pass@k)", gt=0)
    rollout_ranks: int = opt(
        0,
        "ranks that only generate (the last ones of the launch: a rollout engine each, no DeepSpeed engine); the "
        "others train. 0: every rank does both, in turn (colocated). Apart, generation never waits for training: "
        "the rollout ranks sample step t+1 on the weights of step t while the trainer ranks train step t (one "
        "step off-policy, corrected by algorithm.tis_cap), and take each step's weights over the wire, checked "
        "by the sync's probe; validation generates there too, on the weights of the step it follows "
        '(docs/GUIDE.md, "Rollout ranks apart")',
        ge=0,
    )
    collective_timeout_s: float = opt(
        600.0,
        "seconds a collective or store wait may block before the rank fails; a dead peer fails the "
        "survivors at once (connection closed), this bounds the rest (an unreachable node, a hung "
        "rank): keep it above rank 0's longest save",
        gt=0,
    )


@dataclass
class RunConfig:
    """A run: one YAML file, sections below."""

    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    algorithm: AlgorithmConfig = section(AlgorithmConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    roles: RolesConfig = section(RolesConfig)
    precision: PrecisionConfig = section(PrecisionConfig, "per-role dtypes, loss scaling and comm dtypes")
    logging: LoggingConfig = section(LoggingConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    trainer: TrainerConfig = section(TrainerConfig)


# ---------------------------------------------------------------- building from dicts


def _type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check (and lightly coerce: int -> float) a YAML value against a dataclass field type."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return True, None
        return _type_ok(value, args[0])
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        try:  # YAML 1.1 reads `5e-3` (no dot) as a string: accept what parses as a number
            return isinstance(value, str), float(value)
        except ValueError:
            return False, value
    if tp is int and isinstance(value, bool):
        return False, value
    if tp in (int, str, bool):
        return isinstance(value, tp), value
    if tp is list or origin is list:
        return isinstance(value, list), value
    if tp is dict or origin is dict:
        return isinstance(value, dict), value
    return True, value


def from_dict(cls, data: Any, prefix: str = "", errors: list[ConfigError] | None = None):
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types. Every such
    mistake is collected (a bad key keeps its default meanwhile): into `errors` when given, else
    raised together at the end."""
    top = errors is None
    errors = [] if top else errors
    where = prefix.rstrip(".") or "<root>"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        errors.append(ConfigError(where, f"expected a mapping, got {type(data).__name__}"))
        data = {}
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    defaults = cls()  # nested sections start from their parent's defaults, then take the user's keys
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            errors.append(ConfigError(f"{prefix}{key}", f"unknown key{hint}"))
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp) and not isinstance(value, tp):
            if isinstance(value, dict):
                value = {**_shallow(getattr(defaults, key)), **value}
            kwargs[key] = from_dict(tp, value, f"{prefix}{key}.", errors)
            continue
        ok, coerced = _type_ok(value, tp)
        if not ok:
            errors.append(ConfigError(f"{prefix}{key}", f"expected {_type_name(tp)}, got {value!r}"))
            continue
        kwargs[key] = coerced
    try:
        obj = cls(**kwargs)
        if hasattr(obj, "validate"):
            obj.validate(prefix)
    except ConfigError as e:  # a section that checks itself (PrecisionConfig)
        errors.extend(e.errors)
        obj = defaults
    if top:
        raise_all(errors)
    return obj


def _shallow(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    tp = args[0] if args else tp
    return getattr(tp, "__name__", str(tp))


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(text, "an override must look like key.sub=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides or []:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(".".join(path), f"'{part}' is not a section")
        node[path[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(str(p), "config file not found")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except ConfigError as e:  # a key given twice: `:line` -> `file:line`
        raise ConfigError(f"{p}{e.where}", e.message) from None
    except UnicodeDecodeError as e:
        raise ConfigError(str(p), f"not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}{loc}", f"YAML syntax error: {getattr(e, 'problem', e)}") from None
    if data is None:  # an empty file is a mistake (a wrong path, a truncated copy), not "the defaults"
        raise ConfigError(str(p), "the config file is empty (write `{}` for every default)")
    if not isinstance(data, dict):
        raise ConfigError(str(p), "the top level must be a mapping of sections")
    return data


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, world_size: int | None = None
) -> RunConfig:
    """The YAML file + dotted overrides, built and validated once (for `world_size` ranks; default
    `default_world`: $WORLD_SIZE, which the launcher sets)."""
    data = read_yaml(path) if path else {}
    data = apply_overrides(data, overrides or [])
    errors: list[ConfigError] = []  # the structure's mistakes, reported with the values' (one pass)
    cfg = from_dict(RunConfig, data, errors=errors)
    validate(cfg, world_size, errors)
    return cfg


def config_reference() -> str:
    """docs/CONFIG.md: every key of the run config, read from the fields."""
    return markdown(
        RunConfig,
        "Run config reference",
        "Generated from the fields of `verl_ds/config.py` and `verl_ds/precision.py` by `verl-ds config docs > "
        "docs/CONFIG.md` (a test fails when this file is stale). A run config is one YAML file with these sections; "
        "any key may be overridden on the command line as `section.key=value`. Unknown keys, wrong types and values "
        "outside `allowed` are refused, all at once, one line each.",
    )


def _is_str(v) -> bool:
    return isinstance(v, str)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def validate(cfg: RunConfig, world_size: int | None = None, errors: list[ConfigError] | None = None) -> None:
    """Every static check of a run config, in one pass; all mistakes are raised together, each a
    ConfigError naming the key (or file).

    Field types were checked when the config was built; here: each field's choices and bounds (its
    `opt` metadata), each section's own rules (its `check`, next to its fields), the rules between
    sections (`_between_sections`), the names a run resolves (reward function, environment, tools),
    the batch geometry against `world_size` ranks (default: `default_world`) and the facts of each role's
    DeepSpeed JSON file. The model and data paths: `validate_paths`.
    """
    errors = [*(errors or []), *field_errors(cfg)]  # `errors`: what building the config found
    raise_all(errors)  # the rules below assume each field is in range
    world = world_size or default_world(cfg)
    for part in (cfg.model, cfg.data, cfg.algorithm, cfg.rollout, cfg.roles, cfg.precision):
        errors += part.check()
    errors += _between_sections(cfg)
    errors += resolve_names(cfg)[1]
    errors += batch_geometry(cfg, world)
    errors += _ds_file_errors(cfg, dp_world(cfg, world), mini_batch(cfg))
    raise_all(errors)


def _between_sections(cfg: RunConfig) -> list[ConfigError]:
    """The rules that tie one section's fields to another's: the one place they live (a table of
    rules, one entry each, read top to bottom: longer than a function should be, on purpose)."""
    a, r, d, m, mt = cfg.algorithm, cfg.rollout, cfg.data, cfg.model, cfg.rollout.multi_turn
    return broken(
        (
            m.lora.rank > 0 and "critic" in active_roles(cfg),
            "model.lora.rank",
            "LoRA is for the actor of critic-free estimators here (grpo, rloo, ...)",
        ),
        (
            a.overlong.buffer_len > r.max_new_tokens,
            "algorithm.overlong.buffer_len",
            f"must be in [0, rollout.max_new_tokens = {r.max_new_tokens}], got {a.overlong.buffer_len}",
        ),
        (
            a.filter_groups.enabled and r.n < 2,
            "algorithm.filter_groups.enabled",
            "filtering groups by reward variance needs rollout.n >= 2",
        ),
        (
            a.estimator in GROUP_ESTIMATORS and r.n < 2,
            "rollout.n",
            f"estimator '{a.estimator}' compares samples of one prompt: needs n >= 2, got {r.n}",
        ),
        (
            r.max_model_len < d.max_prompt_length + r.max_new_tokens,
            "rollout.max_model_len",
            f"{r.max_model_len} < data.max_prompt_length {d.max_prompt_length} + rollout.max_new_tokens "
            f"{r.max_new_tokens}",
        ),
        (
            bool(d.tools) and mt.env != "tools",
            "data.tools",
            "tools are called through the tool environment: set rollout.multi_turn.env: tools",
        ),
        (
            mt.env == "tools" and not d.tools,
            "data.tools",
            "rollout.multi_turn.env: tools needs at least one tool (e.g. [calculator])",
        ),
        (
            bool(mt.agent) and not d.apply_chat_template,
            "rollout.multi_turn.agent",
            "the agent's endpoint renders chat messages: set data.apply_chat_template: true",
        ),
        (
            r.partial.enabled and r.partial.max_staleness > 0 and a.tis_cap is None,
            "algorithm.tis_cap",
            "partial rollouts train tokens sampled by older weights: set the importance-weight cap (e.g. 2.0), "
            "or rollout.partial.max_staleness: 0",
        ),
        (
            mt.enabled and a.overlong.buffer_len > 0,
            "algorithm.overlong.buffer_len",
            "the overlong penalty measures one response against rollout.max_new_tokens; multi-turn rows hold "
            "several turns",
        ),
        (
            a.distill.coef > 0 and not m.teacher_path,
            "algorithm.distill.coef",
            "distillation needs a teacher: set model.teacher_path",
        ),
        (
            bool(m.teacher_path) and a.distill.coef == 0,
            "model.teacher_path",
            "a teacher is used by distillation only: set algorithm.distill.coef > 0 (or drop the teacher)",
        ),
        *_rollout_ranks_rules(cfg),
        *_sequence_parallel_rules(cfg),
        *(
            (
                getattr(cfg.roles, role).offload_activations
                and (role not in TRAINED_ROLES or not cfg.precision.enable_grad_checkpointing),
                f"roles.{role}.offload_activations",
                "offloads the inputs gradient checkpointing keeps: a trained role, with "
                "precision.enable_grad_checkpointing: true",
            )
            for role in active_roles(cfg)
        ),
    )


def _rollout_ranks_rules(cfg: RunConfig) -> list[tuple[bool, str, str]]:
    """What `trainer.rollout_ranks` > 0 runs today: episodes (single-turn, or an environment's turns: run on
    the rollout ranks) streamed one step ahead (validation too), every row trained once (no partial
    rollouts, no dynamic sampling, no agent jobs); the off-policy step corrected by TIS. The trainer ranks
    may split rows (sequence parallelism): the rollout ranks generate whole rows for them as for any
    trainer rank."""
    k, a, r = cfg.trainer.rollout_ranks, cfg.algorithm, cfg.rollout
    if k == 0:
        return []
    why = f"trainer.rollout_ranks {k}"
    launched = int(os.environ.get("VERL_DS_LAUNCH_WORLD") or os.environ.get("WORLD_SIZE", 0))
    return [
        (
            0 < launched <= k,
            "trainer.rollout_ranks",
            f"{k} of the {launched} ranks launched leaves none to train: at most {launched - 1}",
        ),
        (
            a.tis_cap is None,
            "algorithm.tis_cap",
            f"{why}: rows are sampled by the previous step's weights: set the importance-weight cap (e.g. 2.0)",
        ),
        (r.partial.enabled, "rollout.partial.enabled", f"{why}: the rollout ranks stream whole steps (false)"),
        (
            bool(r.multi_turn.agent),
            "rollout.multi_turn.agent",
            f"{why}: an agent job's episodes run colocated (its endpoint serves the trainer rank's engine), for now",
        ),
        (a.filter_groups.enabled, "algorithm.filter_groups.enabled", f"{why}: one round a step (false)"),
        (r.tensor_parallel_size > 1, "rollout.tensor_parallel_size", f"{why}: with 1 only, for now"),
    ]


def _sequence_parallel_rules(cfg: RunConfig) -> list[tuple[bool, str, str]]:
    """What `trainer.sequence_parallel_size` > 1 needs of the other sections that it cannot set itself (the
    rows run one at a time, split, through DeepSpeed's wrapper of the policy models' attention): what it
    sets, one-row micro-batches, is `micro_rows`. Every model's attention heads (the policy's, a critic's,
    reward model's or teacher's, from their config.json) must split evenly over the group: DeepSpeed's
    all-to-all hands each rank whole heads."""
    sp = cfg.trainer.sequence_parallel_size
    if sp == 1:
        return []
    why = f"trainer.sequence_parallel_size {sp}"
    m = cfg.model
    models = {
        "model.tiny" if m.path == "tiny" else "model.path": m.path,
        "model.critic_path": m.critic_path,
        "model.reward_path": m.reward_path,
    }
    models["model.teacher_path"] = m.teacher_path
    critic = "critic" in active_roles(cfg)
    heads = {k: _heads(cfg, path) for k, path in models.items() if path and (critic or k != "model.critic_path")}
    return [
        *(
            (
                h[0] % sp != 0 or (h[1] % sp != 0 and sp % h[1] != 0),
                "trainer.sequence_parallel_size",
                f"{sp} must divide the {h[0]} attention heads of {key} and divide or be a multiple of its {h[1]} "
                "key/value heads (DeepSpeed's all-to-all hands each rank whole heads)",
            )
            for key, h in heads.items()
            if h
        ),
        (
            cfg.rollout.engine == "hf" and not cfg.trainer.rollout_ranks,  # apart, a rollout rank's model is its own
            "rollout.engine",
            f"{why}: the HF engine generates with the actor's model, whose attention SP replaces; use vllm",
        ),
        (
            cfg.model.packing is True,
            "model.packing",
            f"{why}: rows run one at a time, each split over the group; packing is for unsplit rows",
        ),
        (
            cfg.model.attn_implementation == "eager",
            "model.attn_implementation",
            f"{why}: DeepSpeed's Ulysses SP wraps sdpa or flash attention, not eager",
        ),
    ]


def _heads(cfg: RunConfig, path: str) -> tuple[int, int] | None:
    """(attention heads, key/value heads) of the model at `path` (`tiny`: `model.tiny`); None where its
    config.json is absent or unreadable (`validate_paths` names that)."""
    if path == "tiny":
        return cfg.model.tiny.heads, cfg.model.tiny.heads
    try:
        c = read_json_object(Path(path) / "config.json", "an HF config.json")
        c = c.get("text_config", c)
        return c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    except (ConfigError, OSError, KeyError, TypeError, AttributeError):
        return None


def batch_geometry(cfg: RunConfig, world: int) -> list[ConfigError]:
    """The batch over `world` ranks: tensor-parallel groups, mini-batches and prompts split evenly."""
    r, t = cfg.rollout, cfg.trainer
    batch, mini = t.prompts_per_step * r.n, mini_batch(cfg)
    return broken(
        (
            world % r.tensor_parallel_size != 0,
            "rollout.tensor_parallel_size",
            f"{r.tensor_parallel_size} does not divide the world size {world}",
        ),
        (
            batch % mini != 0,
            "trainer.mini_batch_size",
            f"{mini} does not divide the rollout batch {batch} (trainer.prompts_per_step x rollout.n)",
        ),
        (
            t.prompts_per_step % world != 0,
            "trainer.prompts_per_step",  # every rank runs as many micro-batches
            f"{t.prompts_per_step} prompts do not split evenly over {world} ranks",
        ),
        (
            world % t.sequence_parallel_size != 0,
            "trainer.sequence_parallel_size",
            f"{t.sequence_parallel_size} does not divide the world size {world}",
        ),
    )


def default_world(cfg: RunConfig) -> int:
    """The trainer ranks a config is checked and rendered for when none are given: the launch's ranks
    ($WORLD_SIZE, which the launcher sets; `dist.LAUNCH_WORLD` once the rollout ranks split off) less
    `trainer.rollout_ranks`, else the fewest the run takes (its sequence-parallel group; 1)."""
    launched = int(os.environ.get("VERL_DS_LAUNCH_WORLD") or os.environ.get("WORLD_SIZE", 0))
    return max(launched - cfg.trainer.rollout_ranks, 0) or cfg.trainer.sequence_parallel_size


def dp_world(cfg: RunConfig, world: int) -> int:
    """Data-parallel ranks: the world over the sequence-parallel size (a group's ranks hold the same rows)."""
    return max(1, world // cfg.trainer.sequence_parallel_size)


@dataclass(frozen=True)
class Names:
    """What the names of a run config resolve to: the reward function (`data.reward_fn`, with
    reasoning-gym's threshold), the tools (`data.tools`), the environment factory and the agent of a
    multi-turn job (None: not that kind of job)."""

    reward_fn: Callable | None = None
    tools: tuple = ()
    env_factory: Callable | None = None
    agent: Callable | None = None


def resolve_names(cfg: RunConfig) -> tuple[Names, list[ConfigError]]:
    """The names a run resolves, each imported and its signature checked once: (what resolved, what
    did not). `validate` reports the mistakes (so `config render` catches them too); the run's setup
    keeps the values."""
    out, names = [], {}

    def resolve(key: str, fn) -> None:
        try:
            names[key] = fn()
        except ConfigError as e:
            out.append(e)

    d, mt = cfg.data, cfg.rollout.multi_turn
    resolve("reward_fn", lambda: task_reward_fn(d))
    resolve("tools", lambda: tuple(load_tools(d.tools)))
    tools = list(names.get("tools") or ()) or None
    if mt.env and not (mt.env == "tools" and tools is None):  # no tools: reported above
        resolve("env_factory", lambda: load_env_factory(mt.env, mt.env_kwargs, tools))
    if mt.agent:
        resolve("agent", lambda: load_agent(mt.agent))
    return Names(**names), out


def load_agent(spec: str, key: str = "rollout.multi_turn.agent"):
    """`rollout.multi_turn.agent` resolved: an importable `async def fn(client, example)`, else one
    line naming the key."""
    from verl_ds.rollout.agents import check_agent  # the HTTP stack, imported by agent jobs only

    if ":" not in spec:  # a dotted path may name a module's attribute that is not the agent
        mod, _, attr = spec.rpartition(".")
        hint = f" (e.g. {mod}:{attr})" if mod else ""
        raise ConfigError(key, f"'{spec}': name the agent as module:function{hint}")
    fn = import_object(spec, key)
    check_agent(fn, key)
    return fn


def validate_paths(cfg: RunConfig, missing_ok: bool = False) -> list[str]:
    """The paths a run reads or writes: data files, model directories (an HF model, a tokenizer),
    the run directory (a directory, or creatable) and the checkpoint to resume from. Separate from
    `validate`: a config may be rendered on a machine without its model or data; with `missing_ok`
    an absent path is returned as a note instead of an error (what is there is still checked)."""
    errors, notes = [], []

    def absent(key: str, message: str) -> None:
        (notes.append(f"{key}: {message}") if missing_ok else errors.append(ConfigError(key, message)))

    for key in ("train_files", "val_files"):
        for i, f in enumerate(getattr(cfg.data, key)):
            p = Path(f)
            if not p.exists():
                absent(f"data.{key}[{i}]", f"file not found: {f}")
            elif not p.is_file() or not os.access(p, os.R_OK):
                errors.append(ConfigError(f"data.{key}[{i}]", f"not a readable file: {f}"))
    m = cfg.model
    for key in ("path", "tokenizer_path", "critic_path", "reward_path", "teacher_path"):
        value = getattr(m, key)
        if not value or (key == "path" and value == "tiny"):
            continue
        p = Path(value)
        if not p.exists():
            absent(f"model.{key}", f"directory not found: {value}")
        elif not p.is_dir():
            errors.append(ConfigError(f"model.{key}", f"{value} is a file, not a model directory"))
        elif key != "tokenizer_path" and not (p / "config.json").is_file():
            errors.append(ConfigError(f"model.{key}", f"{value} has no config.json: not an HF model directory"))
        elif key != "tokenizer_path":
            errors += _model_file_errors(p, f"model.{key}")
    tok = m.tokenizer_path or (m.path if m.path != "tiny" else None)
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    key = "model.tokenizer_path" if m.tokenizer_path else "model.path"
    if tok and Path(tok).is_dir() and not any((Path(tok) / f).is_file() for f in tokenizer_files):
        if not any(e.where == key for e in errors):  # one line per directory
            errors.append(ConfigError(key, f"{tok} has no tokenizer (tokenizer.json / tokenizer_config.json)"))
    run_dir = Path(cfg.trainer.run_dir)
    parent = next((q for q in [run_dir, *run_dir.parents] if q.exists()), Path("."))
    if run_dir.exists() and not run_dir.is_dir():
        errors.append(ConfigError("trainer.run_dir", f"{run_dir} is a file, not a directory"))
    elif not parent.is_dir():
        errors.append(ConfigError("trainer.run_dir", f"{parent} is a file: {run_dir} cannot be created"))
    elif not os.access(parent, os.W_OK):
        errors.append(ConfigError("trainer.run_dir", f"{parent} is not writable"))
    resume = cfg.trainer.resume
    if resume not in ("none", "auto"):
        if not Path(resume).exists():
            absent("trainer.resume", f"checkpoint directory not found: {resume}")
        elif not Path(resume).is_dir():
            errors.append(ConfigError("trainer.resume", f"{resume} is a file, not a checkpoint directory"))
    raise_all(errors)
    return notes


def _model_file_errors(model_dir: Path, key: str) -> list[ConfigError]:
    """An HF model directory's files, checked before anything loads them: config.json parses, and
    each safetensors file is whole (a copy cut short loads as a SafetensorError deep in an engine)."""
    try:
        read_json_object(model_dir / "config.json", "an HF config.json")
    except ConfigError as e:
        return [ConfigError(key, f"{e.where}: {e.message}")]
    return [
        ConfigError(key, f"{f}: {problem}")
        for f in sorted(model_dir.glob("*.safetensors"))
        if (problem := safetensors_damage(f))
    ]


def _ds_file_errors(cfg: RunConfig, world: int, mini: int) -> list[ConfigError]:
    """The DeepSpeed JSON file of each active role: readable, a ZeRO stage DeepSpeed has, the
    stage rules of its role and batch keys consistent with the run (the first mistake per file)."""
    out = []
    for role in active_roles(cfg):
        try:
            _check_ds_file(cfg, role, world, mini)
        except ConfigError as e:
            out.append(e)
    return out


def _check_ds_file(cfg: RunConfig, role: str, world: int, mini: int) -> None:
    rc: RoleConfig = getattr(cfg.roles, role)
    ds = read_ds_json(rc.ds_config, f"roles.{role}.ds_config")
    src = str(resolve_ds_path(rc.ds_config))
    if ds.get("fp16", {}).get("enabled") and ds.get("bf16", {}).get("enabled"):
        raise ConfigError(src, f"fp16 and bf16 are both enabled for the {role}")
    json_stage = ds.get("zero_optimization", {}).get("stage", 0)
    if json_stage not in (0, 1, 2, 3) or isinstance(json_stage, bool):
        raise ConfigError(src, f"zero_optimization.stage must be 0, 1, 2 or 3, got {json_stage!r}")
    stage = rc.zero_stage if isinstance(rc.zero_stage, int) else json_stage
    trained = role in TRAINED_ROLES
    if not trained and stage in (1, 2):
        raise ConfigError(
            src, f"the {role} is inference-only: DeepSpeed needs an optimizer for ZeRO stage {stage}; use stage 0 or 3"
        )
    allowed = offload_stages(rc.offload, trained)
    if not allowed:
        raise ConfigError(f"roles.{role}.offload", f"the {role} is frozen: it has no optimizer states to offload")
    if rc.zero_stage != "auto" and stage not in allowed:
        raise ConfigError(
            f"roles.{role}.offload",
            f"offload {rc.offload} needs ZeRO stage {' or '.join(map(str, allowed))}, the {role} runs stage {stage}",
        )
    if rc.sleep and not trained:
        raise ConfigError(f"roles.{role}.sleep", f"the {role} is frozen: sleep applies to trained roles")
    sleep_stages = offload_stages(rc.offload, trained, sleep=True) if rc.sleep else ()
    if rc.sleep and (not sleep_stages or (rc.zero_stage != "auto" and stage not in sleep_stages)):
        raise ConfigError(
            f"roles.{role}.sleep",
            "DeepSpeed moves the states of a ZeRO optimizer (stage >= 1) whose parameters are not offloaded",
        )
    if role in INT8_ROLES and cfg.precision.role_dtype(role) == "int8" and stage != 0:
        raise ConfigError(f"roles.{role}.ds_config", f"an int8 {role} needs a ZeRO stage-0 config")
    total = mini if trained else micro_rows(cfg, role) * world
    where = f"{src} (roles.{role}.micro_batch_size)"
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        v = ds.get(key, "auto")
        if v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ConfigError(src, f'{key} must be a positive integer or "auto", got {v!r}')
    micro = ds.get("train_micro_batch_size_per_gpu", "auto")
    micro = micro_rows(cfg, role) if micro == "auto" else micro
    if ds.get("train_batch_size", "auto") not in ("auto", total):
        raise ConfigError(
            where,
            f"train_batch_size {ds['train_batch_size']} != the run's mini-batch {total} "
            '(trainer.mini_batch_size); use "auto"',
        )
    if total % (micro * world):
        raise ConfigError(where, f"train_batch_size {total} is not divisible by micro batch {micro} x {world} ranks")
    gas = ds.get("gradient_accumulation_steps", "auto")
    if gas != "auto" and gas != total // (micro * world):
        raise ConfigError(
            where, f"gradient_accumulation_steps {gas} != train_batch_size {total} / (micro {micro} x {world} ranks)"
        )


def longest_row(cfg: RunConfig) -> int:
    """The most tokens (prompt + response) one row of this run can hold: a cut prompt and a full
    response, or a multi-turn episode up to its token cap, never past the engine's context."""
    r, mt = cfg.rollout, cfg.rollout.multi_turn
    response = (mt.max_total_tokens or r.max_model_len) if mt.enabled else r.max_new_tokens
    return min(r.max_model_len, cfg.data.max_prompt_length + response)


def position_errors(cfg: RunConfig, c: dict, where: str, engine: str) -> list[ConfigError]:
    """Rows past the model's positions, for every engine: vLLM refuses an engine whose `max_model_len`
    passes them (a traceback from its engine start, with nothing of the run's keys in it); HF generate
    would run on past the positions the model was trained on, silently. A model whose config scales its
    rotary embeddings is left to its engine; `auto` not resolved is checked as vLLM. `c`: the policy's HF
    config (`data.tiny.model_config`), `where` its limit's place in words (`preflight`)."""
    limit = c.get("max_position_embeddings")
    if not isinstance(limit, int) or c.get("rope_scaling"):
        return []
    r, mt = cfg.rollout, cfg.rollout.multi_turn
    if engine in ("vllm", "auto") and r.max_model_len > limit:
        return [
            ConfigError(
                "rollout.max_model_len",
                f"{r.max_model_len:,} is past the model's {limit:,} positions ({where}): at most {limit:,}, with "
                "data.max_prompt_length + rollout.max_new_tokens within it",
            )
        ]
    # vLLM's rows end at max_model_len; HF generate's at the prompt cut plus the new tokens (a multi-turn
    # episode at its token cap, `longest_row`)
    rows = longest_row(cfg) if mt.enabled else cfg.data.max_prompt_length + r.max_new_tokens
    if engine == "hf" and rows > limit:
        keys = "rollout.max_model_len" if mt.enabled else "data.max_prompt_length"
        parts = "rows" if mt.enabled else "data.max_prompt_length + rollout.max_new_tokens"
        return [
            ConfigError(
                keys,
                f"{parts} make rows of up to {rows:,} tokens, past the model's {limit:,} positions ({where}): "
                f"the hf engine would run on past them",
            )
        ]
    return []


def token_budget(cfg: RunConfig, role: str) -> int:
    """`roles.<role>.max_tokens_per_micro_batch` resolved: `auto` is micro_batch_size x
    `longest_row`, the padded tokens of a row micro-batch whose rows all run full length, which the
    user's micro_batch_size already has to fit: packing short rows up to it never needs more memory
    (activations grow with tokens, attention with rows x width^2 <= budget x the longest row). Under
    sequence parallelism none (0): a micro-batch is one row, split over the group."""
    rc = getattr(cfg.roles, role)
    if cfg.trainer.sequence_parallel_size > 1:
        return 0
    if rc.max_tokens_per_micro_batch == "auto":
        return micro_rows(cfg, role) * longest_row(cfg)
    return rc.max_tokens_per_micro_batch


def micro_rows(cfg: RunConfig, role: str) -> int:
    """Rows per micro-batch of `role`: `roles.<role>.micro_batch_size`, or under sequence parallelism one
    (DeepSpeed's SP registration fixes the batch dimension; a row is split over the group): what asking
    for SP asks for, said at start (`sequence_parallel_says`) rather than refused."""
    return 1 if cfg.trainer.sequence_parallel_size > 1 else getattr(cfg.roles, role).micro_batch_size


def sequence_parallel_says(cfg: RunConfig) -> str | None:
    """The start-up line for what `trainer.sequence_parallel_size` > 1 sets in place of the roles' batch
    keys (`micro_rows`, `token_budget`); None when it sets nothing."""
    sp = cfg.trainer.sequence_parallel_size
    unused = [
        f"roles.{role}.{key} {value}"
        for role in active_roles(cfg)
        for key, value, default in (
            ("micro_batch_size", getattr(cfg.roles, role).micro_batch_size, 1),
            ("max_tokens_per_micro_batch", getattr(cfg.roles, role).max_tokens_per_micro_batch, "auto"),
        )
        if sp > 1 and value not in (default, 0)
    ]
    if not unused:
        return None
    return (
        f"trainer.sequence_parallel_size {sp}: every role's micro-batch is one row, or the rows that share a "
        f"prefix as one pack, split over the group ({', '.join(unused)} not used)"
    )


@dataclass(frozen=True)
class Batches:
    """A run's batch arithmetic on `world` ranks, from its config alone (`batches`): derived once and
    read by the DeepSpeed renderer, the memory fit and the loop."""

    dp_world: int  # data-parallel ranks (`dp_world`)
    mini: int  # rows per optimizer step over every rank (`mini_batch`)
    micro: dict[str, int]  # each active role's rows per micro-batch (`micro_rows`)
    token_budgets: dict[str, int]  # each active role's tokens per micro-batch as the config asks (`token_budget`)
    longest_row: int  # (`longest_row`)


def batches(cfg: RunConfig, world: int) -> Batches:
    """The batch arithmetic of `cfg` on `world` ranks (`Batches`)."""
    roles = active_roles(cfg)
    return Batches(
        dp_world(cfg, world),
        mini_batch(cfg),
        {r: micro_rows(cfg, r) for r in roles},
        {r: token_budget(cfg, r) for r in roles},
        longest_row(cfg),
    )


def mini_batch(cfg: RunConfig) -> int:
    """Rows per optimizer step over every rank: `trainer.mini_batch_size`, or the whole rollout batch."""
    return cfg.trainer.mini_batch_size or cfg.trainer.prompts_per_step * cfg.rollout.n


def active_roles(cfg: RunConfig) -> list[str]:
    """The roles this run builds: no critic unless the estimator needs one, no reference without KL,
    no reward engine when a rule function scores, no teacher without distillation."""
    roles = ["actor"]
    if cfg.algorithm.estimator in ESTIMATORS_NEEDING_CRITIC:
        roles.append("critic")
    if cfg.algorithm.kl_coef > 0 and not cfg.model.lora.rank:  # LoRA: the actor with adapters off
        roles.append("reference")
    if cfg.model.reward_path:
        roles.append("reward")
    if cfg.model.teacher_path:
        roles.append("teacher")
    return roles
