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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from verl_ds.algos import (
    ADVANTAGE_ESTIMATORS,
    AGG_LOSS_MODES,
    ESTIMATORS_NEEDING_CRITIC,
    GROUP_ESTIMATORS,
    KL_KINDS,
    POLICY_LOSSES,
)
from verl_ds.errors import ConfigError
from verl_ds.precision import TRAINED_ROLES, PrecisionConfig

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
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(str(path), f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "a DeepSpeed config must be a JSON object")
    return data


@dataclass
class TinyModelConfig:
    """Used when `model.path: tiny`: a random-init char-level Llama is built in the run dir."""

    hidden: int = 128
    layers: int = 2
    heads: int = 4
    ffn: int = 256
    seed: int = 0


@dataclass
class LoraConfig:
    """A LoRA actor (peft): rank 0 = off. The reference is the base with adapters disabled."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    modules_to_save: list = field(default_factory=list)  # trained in full besides the adapters (e.g. norm)


@dataclass
class ModelConfig:
    path: str = "tiny"  # HF directory, or "tiny"
    tokenizer_path: Optional[str] = None  # defaults to `path`
    trust_remote_code: bool = False  # only when asked for
    critic_path: Optional[str] = None  # None: the critic starts from the actor's backbone
    reward_path: Optional[str] = None  # an HF sequence classifier; None: the task's rule reward
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # actor/reference passes run each distinct prompt once, its keys/values shared by its n responses
    # (exact; HF causal LMs with a KV cache; off by itself under gradient checkpointing, which drops caches)
    share_prompt: bool = True


@dataclass
class ArithmeticConfig:
    min_value: int = 0
    max_value: int = 4
    num_operands: int = 2
    ops: str = "+"
    size: int = 10000


@dataclass
class ReasoningGymConfig:
    """`data.task: reasoning_gym`: a generator of the reasoning-gym package (offline)."""

    name: str = "basic_arithmetic"
    size: int = 2000
    seed: int = 0
    val_size: int = 64  # validation: another seed, questions seen in training removed
    val_seed: int = 100003
    config: dict = field(default_factory=dict)  # the generator's own options
    reward_threshold: Optional[float] = None  # partial credit -> 1 if >= threshold else 0


@dataclass
class DataConfig:
    task: str = "arithmetic"  # arithmetic | files
    train_files: list = field(default_factory=list)  # jsonl or parquet, for task: files
    val_files: list = field(default_factory=list)  # held-out prompts, same keys (task: files)
    val_fraction: float = 0.0  # built-in task: distinct prompts held out for validation
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    reward_fn: str = "arithmetic"  # a registry name, a dotted path module:function, or none (env reward only)
    apply_chat_template: bool = False
    system_prompt: Optional[str] = None  # a system message before every prompt (chat template only)
    few_shot: list = field(
        default_factory=list
    )  # chat messages ({role, content}) between the system prompt and each prompt
    tools: list = field(default_factory=list)  # calculator | pkg.module:function; for rollout.multi_turn.env: tools
    max_prompt_length: int = 64
    shuffle: bool = True
    seed: int = 0
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose samples all scored alike, sample more prompts."""

    enabled: bool = False
    metric: str = "acc"  # acc: the rule reward as returned | score: after shaping
    max_rounds: int = 4  # generation rounds per step at most


@dataclass
class OverlongConfig:
    """DAPO soft overlong punishment: linear penalty over the last `buffer_len` tokens."""

    buffer_len: int = 0  # 0: off
    penalty: float = 1.0


@dataclass
class AlgorithmConfig:
    estimator: str = "grpo"  # gae | grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline
    gamma: float = 1.0
    lam: float = 1.0
    ppo_epochs: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: Optional[float] = None
    loss_agg_mode: str = "token-mean"
    entropy_coef: float = 0.0
    vf_clip: Optional[float] = 0.5  # null: no value clipping
    vf_coef: float = 1.0
    kl_estimator: str = "k3"
    use_kl_loss: bool = True  # KL as a loss term (GRPO style) ...
    kl_coef: float = 0.04  # ... or, when use_kl_loss is false, in the reward
    kl_target: Optional[float] = None  # set for the adaptive KL controller (in-reward KL)
    kl_horizon: int = 10000
    reward_normalization: str = "none"  # none | batch | running
    reward_clip: Optional[float] = None
    tis_cap: Optional[float] = None  # truncated IS against the rollout policy when set
    policy_loss: str = "vanilla"  # vanilla (PPO clip) | gspo (sequence ratio) | cispo
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    mask_truncated: bool = False  # samples cut at max_new_tokens contribute no loss


@dataclass
class MultiTurnConfig:
    """Multi-turn episodes (agents, tools, environments); see docs/ENVIRONMENTS.md. No `env`: every
    episode is one turn (a single-turn job)."""

    env: str = ""  # tools | retry | pkg.module:Class (importable from PYTHONPATH)
    env_kwargs: dict = field(default_factory=dict)  # keyword arguments of the environment's constructor
    max_turns: int = 4  # model turns per episode at most
    max_env_tokens: int = 0  # an observation's content is cut to this many tokens (0: no cut)
    max_total_tokens: int = 0  # model + environment tokens per row (0: rollout.max_model_len bounds it)
    tokenization_check: str = "strict"  # strict: compare each episode's ids with a one-shot render (metric) | off


@dataclass
class RolloutConfig:
    engine: str = "vllm"  # vllm | hf | auto (CPU: HF generate for models under 2M params)
    n: int = 8  # samples per prompt
    temperature: float = 1.0  # > 0; the trainer scores with the same temperature
    top_p: float = 1.0  # < 1: rollout logprobs are of the truncated distribution
    max_new_tokens: int = 8
    tensor_parallel_size: int = 1  # ranks that share one vLLM engine; must divide the world size
    enforce_eager: bool = True
    max_model_len: int = 256
    kv_cache_gb: float = 0.25  # CPU: the KV cache size (GPU: gpu_memory_utilization)
    block_size: int = 0  # KV-cache block, tokens (multiple of 32); 0: vLLM's (CPU 128)
    bucket_mb: int = 256  # weight-sync bucket size (bounds peak extra memory)
    gpu_memory_utilization: float = 0.5  # GPU: fraction of device memory vLLM may take
    sleep: bool = True  # GPU: free vLLM's weights and KV cache while training
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class RoleConfig:
    ds_config: str = ""  # a DeepSpeed JSON file (relative: to ds_configs/)
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    micro_batch_size: int = 8  # per rank
    max_tokens_per_micro_batch: int = 0  # > 0: micro-batches by padded tokens instead (dynamic size)
    zero_stage: Any = None  # None: the JSON's | 0-3 | auto: the lowest stage that fits


def _role(ds: str, lr: float = 1e-6) -> RoleConfig:
    return RoleConfig(ds_config=ds, lr=lr)


@dataclass
class RolesConfig:
    actor: RoleConfig = field(default_factory=lambda: _role("actor_zero3_fp32.json", 5e-4))
    critic: RoleConfig = field(default_factory=lambda: _role("critic_zero2_fp32.json", 1e-3))
    reference: RoleConfig = field(default_factory=lambda: _role("ref_zero0.json"))
    reward: RoleConfig = field(default_factory=lambda: _role("reward_zero0.json"))


@dataclass
class WandbConfig:
    mode: str = "offline"  # online | offline | disabled
    project: str = "verl-ds"
    run_name: Optional[str] = None
    entity: Optional[str] = None


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    sample_every: int = 10  # a table of generations every K steps
    memory_every: int = 1  # memory/<stage>/<role>/* every K steps (0: never)
    level: str = "INFO"


@dataclass
class CheckpointConfig:
    every: int = 0  # 0: only at the end
    keep_last: int = 2
    export_dtype: str = "fp32"  # the final HF export of the actor
    export: str = "merged"  # LoRA: merged (an HF model) | adapter (peft format)


@dataclass
class TrainerConfig:
    steps: int = 100
    prompts_per_step: int = 16  # rollout batch, in prompts (x rollout.n samples)
    mini_batch_size: int = 0  # samples per optimizer step; 0: the whole rollout batch
    max_grad_norm: float = 1.0
    seed: int = 1
    run_dir: str = "runs/default"
    resume: str = "none"  # none | auto | <checkpoint dir>
    device: str = "auto"  # auto | cpu | cuda
    val_every: int = 0  # validate every K steps (0: never during training)
    val_before_train: Optional[bool] = None  # None: yes when a validation set exists
    val_n: int = 4  # samples per validation prompt (mean@k, pass@k)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    roles: RolesConfig = field(default_factory=RolesConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


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
    return True, value


def from_dict(cls, data: Any, prefix: str = ""):
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types."""
    where = prefix.rstrip(".") or "<root>"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(where, f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    defaults = cls()  # nested sections start from their parent's defaults, then take the user's keys
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"{prefix}{key}", f"unknown key{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp) and not isinstance(value, tp):
            if isinstance(value, dict):
                value = {**_shallow(getattr(defaults, key)), **value}
            kwargs[key] = from_dict(tp, value, f"{prefix}{key}.")
            continue
        ok, coerced = _type_ok(value, tp)
        if not ok:
            raise ConfigError(f"{prefix}{key}", f"expected {_type_name(tp)}, got {value!r}")
        kwargs[key] = coerced
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate(prefix)
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
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}{loc}", f"YAML syntax error: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(p), "the top level must be a mapping of sections")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    data = read_yaml(path) if path else {}
    data = apply_overrides(data, overrides or [])
    cfg = from_dict(RunConfig, data)
    validate(cfg)
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def validate(cfg: RunConfig, world_size: int | None = None) -> None:
    """Every static check of a run config, each a ConfigError naming the key (or file).

    Field types were checked when the config was built; here: choices, ranges, cross-field rules,
    the model directories, the batch geometry against `world_size` ranks, and the ZeRO-stage facts
    of each role's DeepSpeed JSON file.
    """
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    a, r, t, d = cfg.algorithm, cfg.rollout, cfg.trainer, cfg.data
    choices = {
        "algorithm.estimator": (a.estimator, ADVANTAGE_ESTIMATORS),
        "algorithm.kl_estimator": (a.kl_estimator, KL_KINDS),
        "algorithm.loss_agg_mode": (a.loss_agg_mode, AGG_LOSS_MODES),
        "algorithm.reward_normalization": (a.reward_normalization, ("none", "batch", "running")),
        "algorithm.policy_loss": (a.policy_loss, POLICY_LOSSES),
        "algorithm.filter_groups.metric": (a.filter_groups.metric, ("acc", "score")),
        "rollout.engine": (r.engine, ("vllm", "hf", "auto")),
        "logging.wandb.mode": (cfg.logging.wandb.mode, ("online", "offline", "disabled")),
        "data.task": (d.task, ("arithmetic", "files", "reasoning_gym")),
        "trainer.device": (t.device, ("auto", "cpu", "cuda")),
        "rollout.multi_turn.tokenization_check": (r.multi_turn.tokenization_check, ("strict", "off")),
        "logging.level": (cfg.logging.level, ("DEBUG", "INFO", "WARNING", "ERROR")),
        "checkpoint.export_dtype": (cfg.checkpoint.export_dtype, ("fp32", "fp16", "bf16")),
        "checkpoint.export": (cfg.checkpoint.export, ("merged", "adapter")),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(key, f"'{value}' is not one of {', '.join(allowed)}")
    positive = {
        "trainer.steps": t.steps,
        "trainer.prompts_per_step": t.prompts_per_step,
        "rollout.n": r.n,
        "rollout.max_new_tokens": r.max_new_tokens,
        "rollout.tensor_parallel_size": r.tensor_parallel_size,
        "algorithm.ppo_epochs": a.ppo_epochs,
        "rollout.temperature": r.temperature,
        "algorithm.kl_horizon": a.kl_horizon,
        "trainer.val_n": t.val_n,
        "data.max_prompt_length": d.max_prompt_length,
        "rollout.bucket_mb": r.bucket_mb,
        "algorithm.filter_groups.max_rounds": a.filter_groups.max_rounds,
        "rollout.multi_turn.max_turns": r.multi_turn.max_turns,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(key, f"must be > 0, got {value}")
    for role in ("actor", "critic", "reference", "reward"):
        if getattr(cfg.roles, role).micro_batch_size <= 0:
            raise ConfigError(f"roles.{role}.micro_batch_size", "must be > 0")
        if getattr(cfg.roles, role).max_tokens_per_micro_batch < 0:
            raise ConfigError(f"roles.{role}.max_tokens_per_micro_batch", "must be >= 0 (0: off)")
    if a.dual_clip_c is not None and a.dual_clip_c <= 1:
        raise ConfigError("algorithm.dual_clip_c", f"must be > 1, got {a.dual_clip_c}")
    if a.kl_target is not None:
        if a.kl_target <= 0:
            raise ConfigError("algorithm.kl_target", f"must be > 0, got {a.kl_target}")
        if a.use_kl_loss:
            raise ConfigError(
                "algorithm.kl_target",
                "the adaptive KL controller acts on the in-reward KL; "
                "set algorithm.use_kl_loss: false or drop kl_target",
            )
    if not 0 <= d.val_fraction < 1:
        raise ConfigError("data.val_fraction", f"must be in [0, 1), got {d.val_fraction}")
    if t.val_every < 0:
        raise ConfigError("trainer.val_every", f"must be >= 0, got {t.val_every}")
    if d.val_files and d.task != "files":
        raise ConfigError(
            "data.val_files", "validation files go with task 'files' (the built-in task uses data.val_fraction)"
        )
    if cfg.model.lora.rank < 0 or (cfg.model.lora.rank and not cfg.model.lora.target_modules):
        raise ConfigError("model.lora", "rank must be >= 0 and target_modules non-empty")
    if cfg.model.lora.rank and "critic" in active_roles(cfg):
        raise ConfigError("model.lora.rank", "LoRA is for the actor of critic-free estimators here (grpo, rloo, ...)")
    if a.dual_clip_c is not None and a.policy_loss != "vanilla":
        raise ConfigError(
            "algorithm.dual_clip_c", f"dual clip applies to the vanilla PPO loss only, not '{a.policy_loss}'"
        )
    if not 0 <= a.overlong.buffer_len <= r.max_new_tokens:
        raise ConfigError(
            "algorithm.overlong.buffer_len",
            f"must be in [0, rollout.max_new_tokens = {r.max_new_tokens}], got {a.overlong.buffer_len}",
        )
    if a.filter_groups.enabled and r.n < 2:
        raise ConfigError("algorithm.filter_groups.enabled", "filtering groups by reward variance needs rollout.n >= 2")
    if a.estimator in GROUP_ESTIMATORS and r.n < 2:
        raise ConfigError(
            "rollout.n", f"estimator '{a.estimator}' compares samples of one prompt: needs n >= 2, got {r.n}"
        )
    if r.block_size < 0 or r.block_size % 32:
        raise ConfigError("rollout.block_size", f"must be 0 (vLLM's default) or a multiple of 32, got {r.block_size}")
    if not 0 < r.top_p <= 1:
        raise ConfigError("rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    if r.max_model_len < d.max_prompt_length + r.max_new_tokens:
        raise ConfigError(
            "rollout.max_model_len",
            f"{r.max_model_len} < data.max_prompt_length "
            f"{d.max_prompt_length} + rollout.max_new_tokens {r.max_new_tokens}",
        )
    mt = r.multi_turn
    if mt.max_env_tokens < 0 or mt.max_total_tokens < 0:
        raise ConfigError("rollout.multi_turn", "max_env_tokens and max_total_tokens must be >= 0 (0: no limit)")
    if d.tools and mt.env != "tools":
        raise ConfigError(
            "data.tools", "tools are called through the tool environment: set rollout.multi_turn.env: tools"
        )
    if mt.env == "tools" and not d.tools:
        raise ConfigError("data.tools", "rollout.multi_turn.env: tools needs at least one tool (e.g. [calculator])")
    if mt.env and a.overlong.buffer_len:
        raise ConfigError(
            "algorithm.overlong.buffer_len",
            "the overlong penalty measures one response against "
            "rollout.max_new_tokens; multi-turn rows hold several turns",
        )
    if d.system_prompt is not None and not d.apply_chat_template:
        raise ConfigError("data.system_prompt", "a system prompt needs data.apply_chat_template: true")
    if d.few_shot and not d.apply_chat_template:
        raise ConfigError("data.few_shot", "few-shot chat messages need data.apply_chat_template: true")
    for i, m in enumerate(d.few_shot):
        if not (isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(v, str) for v in m.values())):
            raise ConfigError(f"data.few_shot[{i}]", f"expected {{role: ..., content: ...}} (strings), got {m!r}")
    if d.task == "files" and not d.train_files:
        raise ConfigError("data.train_files", "task 'files' needs at least one jsonl or parquet file")
    # batch geometry over `world` ranks
    if world % r.tensor_parallel_size:
        raise ConfigError(
            "rollout.tensor_parallel_size", f"{r.tensor_parallel_size} does not divide the world size {world}"
        )
    batch = t.prompts_per_step * r.n
    mini = t.mini_batch_size or batch
    if mini <= 0 or batch % mini:
        raise ConfigError(
            "trainer.mini_batch_size",
            f"{mini} does not divide the rollout batch {batch} (trainer.prompts_per_step x rollout.n)",
        )
    if t.prompts_per_step % world:  # every rank must run the same number of micro-batches
        raise ConfigError(
            "trainer.prompts_per_step", f"{t.prompts_per_step} prompts do not split evenly over {world} ranks"
        )
    _validate_ds_files(cfg, world, mini)


def validate_paths(cfg: RunConfig) -> None:
    """The model directories exist and hold an HF model (and a tokenizer). Separate from `validate`:
    a config may be rendered on a machine that lacks the model; a run checks them before anything
    is built."""
    for key in ("train_files", "val_files"):
        for i, f in enumerate(getattr(cfg.data, key)):
            if not Path(f).is_file():
                raise ConfigError(f"data.{key}[{i}]", f"file not found: {f}")
    m = cfg.model
    for key in ("path", "tokenizer_path", "critic_path", "reward_path"):
        value = getattr(m, key)
        if not value or (key == "path" and value == "tiny"):
            continue
        p = Path(value)
        if not p.is_dir():
            raise ConfigError(f"model.{key}", f"directory not found: {value}")
        if key != "tokenizer_path" and not (p / "config.json").is_file():
            raise ConfigError(f"model.{key}", f"{value} has no config.json: not an HF model directory")
    tok = m.tokenizer_path or (m.path if m.path != "tiny" else None)
    if tok and not any(
        (Path(tok) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    ):
        key = "model.tokenizer_path" if m.tokenizer_path else "model.path"
        raise ConfigError(key, f"{tok} has no tokenizer (tokenizer.json / tokenizer_config.json)")


def _validate_ds_files(cfg: RunConfig, world: int, mini: int) -> None:
    """ZeRO-stage rules and batch keys of each active role's DeepSpeed JSON."""
    for role in active_roles(cfg):
        rc: RoleConfig = getattr(cfg.roles, role)
        ds = read_ds_json(rc.ds_config, f"roles.{role}.ds_config")
        src = str(resolve_ds_path(rc.ds_config))
        if ds.get("fp16", {}).get("enabled") and ds.get("bf16", {}).get("enabled"):
            raise ConfigError(src, f"fp16 and bf16 are both enabled for the {role}")
        if rc.zero_stage not in (None, "auto", 0, 1, 2, 3):
            raise ConfigError(f"roles.{role}.zero_stage", f"use 0, 1, 2, 3 or auto, got {rc.zero_stage!r}")
        stage = (
            rc.zero_stage if isinstance(rc.zero_stage, int) else int(ds.get("zero_optimization", {}).get("stage", 0))
        )
        trained = role in TRAINED_ROLES
        if not trained and stage in (1, 2):
            raise ConfigError(
                src,
                f"the {role} is inference-only: DeepSpeed needs an optimizer for ZeRO stage {stage}; use stage 0 or 3",
            )
        if role == "reward" and cfg.precision.reward_dtype == "int8" and stage != 0:
            raise ConfigError("roles.reward.ds_config", "an int8 reward model needs a ZeRO stage-0 config")
        total = mini if trained else rc.micro_batch_size * world
        micro = ds.get("train_micro_batch_size_per_gpu", "auto")
        micro = rc.micro_batch_size if micro == "auto" else micro
        where = f"{src} (roles.{role}.micro_batch_size)"
        if ds.get("train_batch_size", "auto") not in ("auto", total):
            raise ConfigError(
                where,
                f"train_batch_size {ds['train_batch_size']} != the run's mini-batch {total} "
                '(trainer.mini_batch_size); use "auto"',
            )
        if micro <= 0 or total % (micro * world):
            raise ConfigError(
                where, f"train_batch_size {total} is not divisible by micro batch {micro} x {world} ranks"
            )
        gas = ds.get("gradient_accumulation_steps", "auto")
        if gas != "auto" and gas != total // (micro * world):
            raise ConfigError(
                where,
                f"gradient_accumulation_steps {gas} != train_batch_size {total} / (micro {micro} x {world} ranks)",
            )


def active_roles(cfg: RunConfig) -> list[str]:
    """The roles this run builds: no critic unless the estimator needs one, no reference without KL,
    no reward engine when a rule function scores."""
    roles = ["actor"]
    if cfg.algorithm.estimator in ESTIMATORS_NEEDING_CRITIC:
        roles.append("critic")
    if cfg.algorithm.kl_coef > 0 and not cfg.model.lora.rank:  # LoRA: the actor with adapters off
        roles.append("reference")
    if cfg.model.reward_path:
        roles.append("reward")
    return roles
