"""Builds everything one run needs from a RunConfig: the initial model, tokenizer, prompts, every
role's DeepSpeed engine and the rollout engine (DeepSpeed-Chat's rlhf_engine.py, in one place)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from verl_ds.config import RunConfig, active_roles, load_agent, token_budget, validate_paths
from verl_ds.data.chat import ChatCodec
from verl_ds.data.dataset import load_examples, tokenize_prompts
from verl_ds.data.tiny import build_char_tokenizer, build_chat_tokenizer, build_tiny_llama, load_tokenizer
from verl_ds.diagnostics.memory import BYTES, choose_zero_stages, load_shape, role_shapes, rollout_memory, workload
from verl_ds.dist import barrier, on_gpu, rank, world_size
from verl_ds.ds_config import render_ds_configs
from verl_ds.envs import load_env_factory, parse_hermes_tool_calls, tool_schemas
from verl_ds.errors import ConfigError
from verl_ds.precision import ResolvedPrecision
from verl_ds.roles import (
    Actor,
    Critic,
    PolicyRole,
    Reference,
    RewardModel,
    Role,
    Teacher,
    load_causal_lm,
    load_reward_model,
    load_value_model,
)
from verl_ds.roles.lora import AdapterOffReference, apply_lora, tied_embedding_targets
from verl_ds.roles.policy import can_share_prompts
from verl_ds.rollout.agent_server import AgentEpisodes
from verl_ds.rollout.episodes import EpisodeSpec, Sampling, TurnLimits
from verl_ds.rollout.partial import PartialLimits, PartialRollouts
from verl_ds.rollout.weights import eos_token_ids

log = logging.getLogger(__name__)


def resolve_model_path(cfg: RunConfig) -> str:
    """`model.path: tiny` builds a random-init char-level Llama once, under the run dir."""
    validate_paths(cfg)
    if cfg.model.path != "tiny":
        return cfg.model.path
    out = Path(cfg.trainer.run_dir) / "init_model"
    if rank() == 0 and not (out / "config.json").exists():
        t = cfg.model.tiny
        tokenizer = build_chat_tokenizer() if t.tokenizer == "chat" else build_char_tokenizer()
        build_tiny_llama(out, tokenizer, hidden=t.hidden, layers=t.layers, heads=t.heads, ffn=t.ffn, seed=t.seed)
    barrier()
    return str(out)


def build_codec(cfg: RunConfig, tokenizer, model_path: str, tools: list) -> ChatCodec:
    """How prompts and observations become ids: the chat template (with the `tools` of `data.tools`
    and `data.system_prompt`), or the tokenizer alone. Multi-turn runs check the template now."""

    d = cfg.data
    schemas = tool_schemas(tools) if tools else None
    codec = ChatCodec(
        tokenizer,
        d.apply_chat_template,
        schemas,
        d.system_prompt,
        model=cfg.model.path,
        eos_ids=eos_token_ids(model_path),
        few_shot=d.few_shot,
    )
    if cfg.rollout.multi_turn.enabled:
        codec.check_turns()
    return codec


def build_episodes(cfg: RunConfig, codec: ChatCodec, tools: list) -> EpisodeSpec | None:
    """A multi-turn job's `EpisodeSpec` for `episodes.collect`: the environment factory, the codec,
    the limits, the tokenization check. None: single-turn (no `rollout.multi_turn.env`)."""
    mt = cfg.rollout.multi_turn
    if not mt.env:
        return None
    limits = TurnLimits(
        mt.max_turns, mt.max_env_tokens, mt.max_total_tokens, cfg.rollout.max_model_len, mt.max_env_failure_fraction
    )
    return EpisodeSpec(
        env_factory=load_env_factory(mt.env, mt.env_kwargs, tools or None),
        codec=codec,
        limits=limits,
        strict=mt.tokenization_check == "strict",
    )


def build_agents(cfg: RunConfig, codec: ChatCodec, engine) -> AgentEpisodes | None:
    """An agent job's episodes (`rollout.multi_turn.agent`) over this rank's rollout `engine`; its
    endpoint starts at the first collect. None: not an agent job."""
    mt = cfg.rollout.multi_turn
    if not mt.agent:
        return None
    agent = load_agent(mt.agent)
    return AgentEpisodes(agent, engine, codec, cfg.rollout.max_model_len, mt.agent_timeout_s, parse_hermes_tool_calls)


def build_partial(
    cfg: RunConfig, engine, prompts: list[dict], draw, world: int, spec: EpisodeSpec | None
) -> PartialRollouts | None:
    """This rank's pool of partial rollouts (`rollout.partial`) over `prompts`; `draw()` gives the
    indices of this rank's next prompts. None: every step generates its own batch to the end."""
    r = cfg.rollout
    if not r.partial.enabled:
        return None
    b = cfg.trainer.prompts_per_step // world
    limits = PartialLimits(
        groups_per_step=b,
        max_staleness=r.partial.max_staleness,
        in_flight=math.ceil(b * (1 + r.partial.over_provision)),
        chunk_tokens=r.partial.chunk_tokens or max(1, r.max_new_tokens // 4),
    )
    sampling = Sampling(r.n, r.temperature, r.top_p, r.max_new_tokens)
    return PartialRollouts(engine, limits, prompts, draw, sampling, cfg.trainer.seed, spec)


def build_prompts(cfg: RunConfig, tokenizer, codec: ChatCodec | None = None) -> tuple[list[dict], list[dict]]:
    """Tokenized (train, validation) prompts."""
    d = cfg.data
    train, val = (
        tokenize_prompts(x, tokenizer, d.max_prompt_length, d.apply_chat_template, codec) for x in load_examples(d)
    )
    if not train:
        raise ConfigError("data", "the prompt dataset is empty")
    return train, val


def rank_budget(cfg: RunConfig, world: int) -> float:
    """The bytes one rank may use: its GPU (less vLLM's share when vLLM keeps it while the roles
    train), or this node's RAM over the ranks on it."""
    import torch

    if on_gpu():
        budget = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        if not cfg.rollout.sleep and cfg.rollout.engine == "vllm":
            budget *= 1 - cfg.rollout.gpu_memory_utilization  # vLLM keeps its share while training
        return budget
    import os

    import psutil

    return psutil.virtual_memory().total / int(os.environ.get("LOCAL_SIZE", world))


def check_batch_fits(cfg: RunConfig, model_path: str, precision: ResolvedPrecision, world: int) -> None:
    """Refuse, before any engine, a rollout batch whose own buffers (the `debug memory` estimate of its
    ids, masks and logprobs, and HF generate's cache) exceed this rank's memory whatever the ZeRO
    stage: `rollout.n: 1000000000` is one line now, not a MemoryError or the OOM killer later."""
    budget, shape, w, dtype = rank_budget(cfg, world), load_shape(model_path), workload(cfg, world), precision.rollout
    weights = shape.params("lm") * BYTES[dtype]  # only the rollout stage's batch terms are read below
    gen = rollout_memory(shape, cfg.rollout, dtype, w, 0.0, budget / 2**30 if on_gpu() else None, weights)["rollout"]
    need = gen.get("logits_buffer", 0.0) + (gen.get("kv_cache", 0.0) if cfg.rollout.engine == "hf" else 0.0)
    if need > budget:
        raise ConfigError(
            "rollout.n",
            f"trainer.prompts_per_step x rollout.n = {cfg.trainer.prompts_per_step * cfg.rollout.n:,} rows "
            f"({w.gen_batch:,} per engine) of up to {w.seq_len} tokens need ~{need / 2**30:,.1f} GiB to generate, "
            f"over this rank's {budget / 2**30:,.1f} GiB: lower rollout.n, trainer.prompts_per_step or "
            "rollout.max_new_tokens",
        )


def zero_stages(cfg: RunConfig, model_path: str, precision: ResolvedPrecision, world: int) -> dict[str, int]:
    """What `roles.<role>.zero_stage: auto` means here: the lowest stage whose analytic estimate (the
    `debug memory` model) fits this rank's device (GPU memory, or RAM / ranks on this node)."""
    auto = [r for r in active_roles(cfg) if getattr(cfg.roles, r).zero_stage == "auto"]
    if not auto:
        return {}
    budget = rank_budget(cfg, world)
    ds = render_ds_configs(cfg, world, precision)
    chosen = choose_zero_stages(cfg, load_shape(model_path), ds, world, budget, auto, role_shapes=role_shapes(cfg))
    log.info("zero_stage auto -> %s (budget %.1f GiB per rank)", chosen, budget / 2**30)
    return chosen


def build_roles(cfg: RunConfig, model_path: str, precision: ResolvedPrecision) -> dict:
    """One DeepSpeed engine per active role, each from its own rendered config."""
    ds = render_ds_configs(cfg, precision=precision, zero_stages=zero_stages(cfg, model_path, precision, world_size()))
    p, m = cfg.precision, cfg.model
    gc = p.enable_grad_checkpointing
    fp32_head, lora = precision.lm_head_fp32, m.lora
    policy = load_causal_lm(model_path, m.trust_remote_code, gc, fp32_head)
    if lora.rank:
        tied = tied_embedding_targets(policy, lora.target_modules)
        if tied:  # adapters on a tied embedding cannot be merged into the engine's one matrix
            raise ConfigError(
                "model.lora.target_modules",
                f"{tied} is this model's tied input/output embedding: train it in full with modules_to_save instead",
            )
        policy = apply_lora(policy, lora.rank, lora.alpha, lora.dropout, lora.target_modules, lora.modules_to_save)
    roles = {"actor": Actor(policy, ds["actor"], cfg.algorithm, temperature=cfg.rollout.temperature)}
    if lora.rank and cfg.algorithm.kl_coef > 0:
        roles["reference"] = AdapterOffReference(roles["actor"])
    if "critic" in active_roles(cfg):
        roles["critic"] = Critic(
            load_value_model(m.critic_path or model_path, m.trust_remote_code, gc), ds["critic"], cfg.algorithm
        )
    if "reference" in ds:
        roles["reference"] = Reference(
            load_causal_lm(model_path, m.trust_remote_code, lm_head_fp32=fp32_head), ds["reference"]
        )
    if "reward" in ds:
        roles["reward"] = RewardModel(
            load_reward_model(m.reward_path, m.trust_remote_code),
            ds["reward"],
            int8_activation=precision.reward_activation if precision.reward == "int8" else None,
        )
    if "teacher" in ds:
        roles["teacher"] = Teacher(
            load_causal_lm(m.teacher_path, m.trust_remote_code, lm_head_fp32=fp32_head),
            ds["teacher"],
            int8_activation=precision.teacher_activation if precision.teacher == "int8" else None,
        )
    for name, role in roles.items():
        if isinstance(role, Role):  # a LoRA reference runs on the actor's engine and budget
            role.max_tokens = token_budget(cfg, name)
        if isinstance(role, PolicyRole):
            role.share_prompts = m.share_prompt and can_share_prompts(role.module)
    return roles


def build_tokenizer(cfg: RunConfig, model_path: str):
    """The student's tokenizer; with a teacher, checked to give the teacher's ids (`check_teacher_tokenizer`)."""
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or model_path, cfg.model.trust_remote_code)
    if cfg.model.teacher_path:
        check_teacher_tokenizer(tokenizer, load_tokenizer(cfg.model.teacher_path, cfg.model.trust_remote_code))
    return tokenizer


def check_teacher_tokenizer(student, teacher) -> None:
    """Distillation compares the two models' logprobs of the same token ids, so every id must name
    the same token in both vocabularies (a smaller or larger model of one family shares them)."""
    s_vocab, t_vocab = ({i: tok for tok, i in x.get_vocab().items()} for x in (student, teacher))
    for i in sorted(set(s_vocab) | set(t_vocab)):
        a, b = s_vocab.get(i), t_vocab.get(i)
        if a != b:
            raise ConfigError(
                "model.teacher_path",
                f"the teacher's tokenizer differs from the student's at id {i} (student {a!r}, teacher {b!r}): "
                "distillation needs the same token ids",
            )
