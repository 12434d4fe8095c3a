"""Builds everything one run needs from its `RunSetup` (trainer/setup.py), in one call (`build` ->
`RunParts`): its model, its data side (`build_data`: the tokenizer, the codec, the
job's episodes, the prompts and their sampler), every role's DeepSpeed engine (`build_roles`,
DeepSpeed-Chat's rlhf_engine.py in one place), the rollout engine, the loop's helpers (rewards, the
sync's probe, the step's metrics), what runs on the rollout engine besides the loop's own episodes
(`build_agents`, `build_partial`) and the state a checkpoint keeps (`LoopState`)."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

from verl_ds import algos
from verl_ds.config import RunConfig
from verl_ds.data.chat import ChatCodec
from verl_ds.data.dataset import PromptSampler, tokenize_prompts
from verl_ds.data.tasks import load_examples
from verl_ds.data.tiny import load_tokenizer, prepare_model
from verl_ds.dist import bridge
from verl_ds.envs import parse_hermes_tool_calls, tool_schemas
from verl_ds.errors import ConfigError
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
from verl_ds.rollout import make_rollout
from verl_ds.rollout.agents import AgentEpisodes
from verl_ds.rollout.engines.remote import RemoteRollout
from verl_ds.rollout.engines.vllm_internals import batch_invariant_kernels
from verl_ds.rollout.engines.weights import eos_token_ids
from verl_ds.rollout.episodes import EpisodeSpec, Sampling, TurnLimits
from verl_ds.rollout.partial import PartialLimits, PartialRollouts
from verl_ds.rollout.partial.agents import PartialAgents
from verl_ds.trainer.checkpoint import LoopState, resumed_step
from verl_ds.trainer.metrics import StepMetrics
from verl_ds.trainer.probe import SyncProbe
from verl_ds.trainer.rewards import Rewards
from verl_ds.trainer.setup import RunSetup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunParts:
    """What one run is built from (`build`), each part once; the loop reads them."""

    model_path: str  # `model.path`, or the tiny model built under the run dir (`data.tiny.prepare_model`)
    data: RunData
    roles: dict  # name -> role (`build_roles`)
    rollout: Any  # this rank's rollout engine (`rollout.make_rollout`)
    rewards: Rewards
    probe: SyncProbe
    step_metrics: StepMetrics
    agents: AgentEpisodes | None  # None: not an agent job
    partial: PartialRollouts | None  # None: each step generates its own batch to the end
    state: LoopState  # what a checkpoint keeps beside the roles


def build(setup: RunSetup) -> RunParts:
    """Every part of the run, each after the ones it needs: the model (the tiny one built under the run
    dir, once the setup has refused nothing), the data before any engine (what it refuses, refused
    first), the roles' engines, then the rollout engine (on a GPU vLLM sizes its cache from the memory
    the roles left)."""
    s, cfg = setup, setup.cfg
    if s.precision.batch_invariant:  # the process's kernels, before any model runs (`precision.batch_invariant`)
        batch_invariant_kernels()
    model_path = prepare_model(cfg.model, cfg.trainer.run_dir)
    data = build_data(s, model_path)
    roles = build_roles(s, model_path)
    p = s.precision
    rollout = build_rollout(s, model_path, data)
    rewards = Rewards(cfg, s.reward_fn, roles.get("reward"), data.tokenizer, s.rank)
    probe = SyncProbe(data.prompts, cfg.trainer.seed, cfg.rollout.temperature, p.actor, p.rollout)
    step_metrics = StepMetrics(cfg.algorithm, roles, rollout, data.sampler)
    agents = build_agents(s, data.codec, rollout)
    draw = functools.partial(data.sampler.draw, cfg.trainer.prompts_per_step, s.rank, s.world)
    partial = build_partial(s, rollout, data.prompts, draw, data.episode_spec, agents)
    a = cfg.algorithm
    kl_ctl = (
        algos.AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon)
        if a.kl_target
        else algos.FixedKLController(a.kl_coef)
    )
    t = cfg.trainer
    placement = {"world": s.world, "sequence_parallel_size": t.sequence_parallel_size, "rollout_ranks": t.rollout_ranks}
    state = LoopState(data.sampler, kl_ctl, rewards.stats, partial, placement, rollout if t.rollout_ranks else None)
    return RunParts(model_path, data, roles, rollout, rewards, probe, step_metrics, agents, partial, state)


@dataclass(frozen=True)
class RunData:
    """The run's data side, built once (`build_data`) and read by the loop."""

    tokenizer: Any  # the student's
    codec: ChatCodec  # prompts and observations as ids
    episode_spec: EpisodeSpec | None  # a multi-turn job's episodes; None: single-turn
    prompts: list[dict]  # the training prompts, tokenized
    val_prompts: list[dict]  # the held-out prompts, tokenized ([]: no validation)
    sampler: PromptSampler  # the order the training prompts are drawn in (resumable)


def build_data(setup: RunSetup, model_path: str) -> RunData:
    """The student's tokenizer, the codec and a multi-turn job's `EpisodeSpec` (`build_episodes`); the
    (train, validation) prompts and the sampler over the first."""
    d = setup.cfg.data
    tokenizer, codec, spec = build_episodes(setup.cfg, model_path, setup.tools, setup.env_factory)
    train, val = load_examples(d)
    if not train:
        raise ConfigError("data", "the prompt dataset is empty")
    sampler = PromptSampler(len(train), d.seed, d.shuffle)
    prompts, val_prompts = (
        tokenize_prompts(x, tokenizer, d.max_prompt_length, d.apply_chat_template, codec) for x in (train, val)
    )
    return RunData(tokenizer, codec, spec, prompts, val_prompts, sampler)


def build_episodes(
    cfg: RunConfig, model_path: str, tools: tuple, env_factory
) -> tuple[Any, ChatCodec, EpisodeSpec | None]:
    """What episodes are run with, where they run (the trainer rank, or a rollout rank apart:
    `trainer/rollout_rank.py`): the student's tokenizer (a teacher's gives the same ids: the setup checked it);
    the codec: the chat template with the `tools` of `data.tools` and `data.system_prompt`, or the tokenizer
    alone (multi-turn runs check the template now); a multi-turn job's `EpisodeSpec` (`rollout.multi_turn.env`:
    the environment factory, the codec, the turn limits, the tokenization check), None: single-turn."""
    m, d, mt = cfg.model, cfg.data, cfg.rollout.multi_turn
    eos_ids = eos_token_ids(model_path)
    tokenizer = load_tokenizer(m.tokenizer_path or model_path, m.trust_remote_code)
    schemas = tool_schemas(tools) if tools else None
    codec = ChatCodec(
        tokenizer, d.apply_chat_template, schemas, d.system_prompt, model=m.path, eos_ids=eos_ids, few_shot=d.few_shot
    )
    if mt.enabled:
        codec.check_turns()
    spec = None
    if env_factory is not None:
        limits = TurnLimits(
            mt.max_turns, mt.max_env_tokens, mt.max_total_tokens, cfg.rollout.max_model_len, mt.max_env_failure_fraction
        )
        spec = EpisodeSpec(env_factory, codec, limits, strict=mt.tokenization_check == "strict")
    return tokenizer, codec, spec


def build_rollout(setup: RunSetup, model_path: str, data: RunData):
    """This rank's rollout engine (`rollout.make_rollout`), or where rollout ranks run apart
    (`trainer.rollout_ranks`) the stream from its rollout rank, told by trainer rank 0 what to serve."""
    cfg, p = setup.cfg, setup.precision
    if not cfg.trainer.rollout_ranks:
        return make_rollout(
            cfg.rollout, model_path, p.rollout, cfg.trainer.seed, cfg.model.trust_remote_code, p.lm_head_fp32
        )
    handshake = {
        "model_path": model_path,
        "engine": cfg.rollout.engine,
        "enforce_eager": cfg.rollout.enforce_eager,
        "rollout_dtype": p.rollout,
        "actor_dtype": p.actor,
        "lm_head_fp32": p.lm_head_fp32,
        "batch_invariant": p.batch_invariant,
        "prompts": data.prompts,
        "val_prompts": data.val_prompts,
        "trainers": setup.world,
        # a resumed run's stream starts after the checkpoint's step (its rows are in the checkpoint)
        "start": resumed_step(setup.resume_from) if setup.resume_from is not None else 0,
    }
    return RemoteRollout(bridge(), setup.rank, data.tokenizer.pad_token_id, cfg.trainer.steps).connect(handshake)


def build_agents(setup: RunSetup, codec: ChatCodec, engine) -> AgentEpisodes | None:
    """An agent job's episodes (`rollout.multi_turn.agent`) over this rank's rollout `engine`; its
    endpoint starts at the first collect. None: not an agent job."""
    if setup.agent is None:
        return None
    r = setup.cfg.rollout
    mt = r.multi_turn
    return AgentEpisodes(
        setup.agent,
        engine,
        codec,
        r.max_model_len,
        mt.agent_timeout_s,
        parse_hermes_tool_calls,
        max_failure_fraction=mt.max_agent_failure_fraction,
    )


def build_partial(
    setup: RunSetup, engine, prompts: list[dict], draw, spec: EpisodeSpec | None, agents: AgentEpisodes | None
) -> PartialRollouts | None:
    """This rank's pool of partial rollouts (`rollout.partial`) over `prompts`; `draw()` gives the
    indices of this rank's next prompts; an agent job's pool runs `agents`' agent. None: every step
    generates its own batch to the end."""
    cfg = setup.cfg
    r = cfg.rollout
    if not r.partial.enabled:
        return None
    b = cfg.trainer.prompts_per_step // setup.world
    limits = PartialLimits(
        groups_per_step=b,
        max_staleness=r.partial.max_staleness,
        in_flight=math.ceil(b * (1 + r.partial.over_provision)),
        chunk_tokens=r.partial.chunk_tokens or max(1, r.max_new_tokens // 4),
        tail_fraction=r.partial.tail_fraction,
    )
    sampling = Sampling(r.n, r.temperature, r.top_p, r.max_new_tokens, r.top_k)
    if agents is not None:
        return PartialAgents(engine, limits, prompts, draw, sampling, cfg.trainer.seed, agents)
    return PartialRollouts(engine, limits, prompts, draw, sampling, cfg.trainer.seed, spec)


def build_roles(setup: RunSetup, model_path: str) -> dict:
    """One DeepSpeed engine per active role, each from its own rendered config (`setup.ds`)."""
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
