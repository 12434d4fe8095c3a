"""Every role's engine for one run (`build_roles`), from the facts the run's setup resolved
(`trainer/setup.py`'s `RunSetup`, read through `RoleSetup`: the roles know nothing of the loop)."""

from __future__ import annotations

import logging
from typing import Mapping, Protocol

from verl_ds.algos import TokenDist
from verl_ds.config import RunConfig
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
from verl_ds.roles.long_rows import tile_mlps
from verl_ds.roles.lora import AdapterOffReference, apply_lora, tied_embedding_targets
from verl_ds.roles.sequence_parallel import SequenceParallel

log = logging.getLogger(__name__)


class RoleSetup(Protocol):
    """What the roles' engines are built from: the run's resolved facts (`trainer.setup.RunSetup` holds them)."""

    cfg: RunConfig
    gpu: bool  # the engines run on this rank's GPU
    precision: ResolvedPrecision
    roles: tuple[str, ...]  # the active roles
    ds: Mapping[str, dict]  # each active role's DeepSpeed config, as its engine receives it
    token_budgets: Mapping[str, int]  # each role's tokens per micro-batch
    attention: str  # the policy models' attention implementation
    packing: bool  # the policy models' passes run padding-free rows
    share_prefixes: bool  # every role's passes run a prefix its rows share once
    share_min_tokens: int  # ... where that saves at least this many tokens a row
    sampled: TokenDist  # what the rollout samples each token from, and the actor scores it under


def build_roles(setup: RoleSetup, model_path: str) -> dict:
    """One DeepSpeed engine per active role, each from its own rendered config (`setup.ds`), DeepSpeed-Chat's
    rlhf_engine.py in one place: the policy model (LoRA adapters on it), DeepSpeed's SP group and attention
    wrapper before any engine, then each active role's model and engine, and what each role's passes need."""
    cfg, ds, precision = setup.cfg, setup.ds, setup.precision
    p, m = cfg.precision, cfg.model
    gc = p.enable_grad_checkpointing
    fp32_head, lora = precision.lm_head_fp32, m.lora
    attn = setup.attention
    # the reward model's: under SP the policy's (DeepSpeed wraps it), else SDPA (it takes a shared prefix's mask)
    reward_attn = attn if cfg.trainer.sequence_parallel_size > 1 else "sdpa"
    policy = load_causal_lm(model_path, m.trust_remote_code, gc, fp32_head, attn)
    # before any engine: DeepSpeed's SP group and attention wrapper are the process's, every role's
    size = cfg.trainer.sequence_parallel_size
    sp = SequenceParallel.register(policy, size, attn) if size > 1 else None
    if lora.rank:
        tied = tied_embedding_targets(policy, lora.target_modules)
        if tied:  # adapters on a tied embedding cannot be merged into the engine's one matrix
            raise ConfigError(
                "model.lora.target_modules",
                f"{tied} is this model's tied input/output embedding: train it in full with modules_to_save instead",
            )
        policy = apply_lora(policy, lora.rank, lora.alpha, lora.dropout, lora.target_modules, lora.modules_to_save)
    roles = {"actor": Actor(policy, ds["actor"], cfg.algorithm, dist=setup.sampled, sp=sp)}
    if lora.rank and cfg.algorithm.kl_coef > 0:
        roles["reference"] = AdapterOffReference(roles["actor"])
    if "critic" in setup.roles:
        roles["critic"] = Critic(
            load_value_model(m.critic_path or model_path, m.trust_remote_code, gc, attn),
            ds["critic"],
            cfg.algorithm,
            sp=sp,
        )
    if "reference" in setup.roles:
        roles["reference"] = Reference(
            load_causal_lm(model_path, m.trust_remote_code, lm_head_fp32=fp32_head, attn_implementation=attn),
            ds["reference"],
            sp=sp,
        )
    if "reward" in setup.roles:
        roles["reward"] = RewardModel(
            load_reward_model(m.reward_path, m.trust_remote_code, reward_attn),
            ds["reward"],
            int8_activation=precision.reward_activation if precision.reward == "int8" else None,
            sp=sp,
        )
    if "teacher" in setup.roles:
        roles["teacher"] = Teacher(
            load_causal_lm(m.teacher_path, m.trust_remote_code, lm_head_fp32=fp32_head, attn_implementation=attn),
            ds["teacher"],
            int8_activation=precision.teacher_activation if precision.teacher == "int8" else None,
            sp=sp,
        )
    for name, role in roles.items():
        if isinstance(role, Role):  # the GPU's memory only (setup.py logs the CPU's no-op)
            role.offload_activations = getattr(cfg.roles, name).offload_activations and setup.gpu
        if isinstance(role, Role) and getattr(cfg.roles, name).tiled_mlp:
            log.info("roles.%s.tiled_mlp: %d MLPs run in sequence tiles", name, tile_mlps(role.module))
        if isinstance(role, Role):  # a LoRA reference runs on the actor's engine and budget
            role.max_tokens = setup.token_budgets[name]
        if isinstance(role, Role):  # rows that share a prefix run it once (`roles/prefix.py`), under its mask
            role.share_prefixes, role.share_min_tokens = setup.share_prefixes, setup.share_min_tokens
            role.attention = reward_attn if name == "reward" else attn  # as each was loaded
        if isinstance(role, PolicyRole):  # padding-free rows where a micro-batch shares no prefix
            role.packing = setup.packing
    return roles
