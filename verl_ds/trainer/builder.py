"""Builds everything one run needs from a RunConfig: the initial model, tokenizer, prompts, every
role's DeepSpeed engine and the rollout engine (DeepSpeed-Chat's rlhf_engine.py, in one place)."""
from __future__ import annotations

import logging
from pathlib import Path

from verl_ds.config import RunConfig, active_roles, validate_paths
from verl_ds.data.dataset import load_examples, tokenize_prompts
from verl_ds.data.tiny import build_char_tokenizer, build_tiny_llama, load_tokenizer
from verl_ds.ds_config import render_ds_configs
from verl_ds.errors import ConfigError
from verl_ds.precision import ResolvedPrecision
from verl_ds.roles import (Actor, Critic, Reference, RewardModel, load_causal_lm, load_reward_model,
                           load_value_model)
from verl_ds.roles.lora import AdapterOffReference, apply_lora
from verl_ds.dist import barrier, rank

log = logging.getLogger(__name__)


def resolve_model_path(cfg: RunConfig) -> str:
    """`model.path: tiny` builds a random-init char-level Llama once, under the run dir."""
    validate_paths(cfg)
    if cfg.model.path != "tiny":
        return cfg.model.path
    out = Path(cfg.trainer.run_dir) / "init_model"
    if rank() == 0 and not (out / "config.json").exists():
        t = cfg.model.tiny
        build_tiny_llama(out, build_char_tokenizer(), hidden=t.hidden, layers=t.layers, heads=t.heads,
                         ffn=t.ffn, seed=t.seed)
    barrier()
    return str(out)


def build_prompts(cfg: RunConfig, tokenizer) -> tuple[list[dict], list[dict]]:
    """Tokenized (train, validation) prompts."""
    d = cfg.data
    train, val = (tokenize_prompts(x, tokenizer, d.max_prompt_length, d.apply_chat_template) for x in load_examples(d))
    if not train:
        raise ConfigError("data", "the prompt dataset is empty")
    return train, val


def build_roles(cfg: RunConfig, model_path: str, precision: ResolvedPrecision) -> dict:
    """One DeepSpeed engine per active role, each from its own rendered config."""
    ds = render_ds_configs(cfg, precision=precision)
    p, m = cfg.precision, cfg.model
    gc = p.enable_grad_checkpointing
    fp32_head, lora = precision.lm_head_fp32, m.lora
    policy = load_causal_lm(model_path, m.trust_remote_code, gc, fp32_head)
    if lora.rank:
        policy = apply_lora(policy, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    roles = {"actor": Actor(policy, ds["actor"], cfg.algorithm, temperature=cfg.rollout.temperature)}
    if lora.rank and cfg.algorithm.kl_coef > 0:
        roles["reference"] = AdapterOffReference(roles["actor"])
    if "critic" in active_roles(cfg):
        roles["critic"] = Critic(load_value_model(m.critic_path or model_path, m.trust_remote_code, gc),
                                 ds["critic"], cfg.algorithm)
    if "reference" in ds:
        roles["reference"] = Reference(load_causal_lm(model_path, m.trust_remote_code, lm_head_fp32=fp32_head),
                                       ds["reference"])
    if "reward" in ds:
        dtype = precision.reward
        roles["reward"] = RewardModel(load_reward_model(m.reward_path, dtype, precision.reward_activation,
                                                        m.trust_remote_code), ds["reward"], int8=dtype == "int8")
    return roles


def build_tokenizer(cfg: RunConfig, model_path: str):
    return load_tokenizer(cfg.model.tokenizer_path or model_path, cfg.model.trust_remote_code)
