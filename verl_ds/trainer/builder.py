"""Builds everything one run needs from its `RunSetup` (trainer/setup.py), in one call (`build` ->
`RunParts`), top to bottom: its model, its data side (`build_data`: the tokenizer, the codec, the
job's episodes, the prompts and their sampler), every role's DeepSpeed engine (`roles.build.build_roles`),
the rollout engine, what runs on it besides the loop's own episodes (an agent job's agents, partial
rollouts), the loop's helpers (rewards, the sync's probe, the step's metrics) and the state a checkpoint
keeps (`LoopState`)."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

from verl_ds import algos
from verl_ds.checkpoint import LoopState
from verl_ds.config import RunConfig
from verl_ds.data.chat import ChatCodec
from verl_ds.data.dataset import PromptSampler, tokenize_prompts
from verl_ds.data.tasks import load_examples
from verl_ds.data.tiny import load_tokenizer, prepare_model
from verl_ds.dist import bridge
from verl_ds.envs import parse_hermes_tool_calls, tool_schemas
from verl_ds.errors import ConfigError
from verl_ds.roles.build import build_roles
from verl_ds.rollout import make_rollout
from verl_ds.rollout.agents import AgentEpisodes
from verl_ds.rollout.engines.remote import RemoteRollout
from verl_ds.rollout.engines.vllm_internals import batch_invariant_kernels
from verl_ds.rollout.engines.weights import eos_token_ids
from verl_ds.rollout.episodes import EpisodeSpec, TurnLimits
from verl_ds.rollout.partial import PartialLimits, PartialRollouts
from verl_ds.rollout.partial.agents import PartialAgents
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
    """Every part of the run, each after the ones it needs, top to bottom: the model (the tiny one built
    under the run dir, once the setup has refused nothing), the data before any engine (what it refuses,
    refused first), the roles' engines (`roles/build.py`), then the rollout engine (on a GPU vLLM sizes its
    cache from the memory the roles left) and what runs on it besides the loop's own episodes (an agent
    job's agents, partial rollouts' pool), and last the loop's helpers and the state a checkpoint keeps."""
    s, cfg = setup, setup.cfg
    p, r, t, a = s.precision, cfg.rollout, cfg.trainer, cfg.algorithm
    if p.batch_invariant:  # the process's kernels, before any model runs (`precision.batch_invariant`)
        batch_invariant_kernels()
    model_path = prepare_model(cfg.model, t.run_dir)
    data = build_data(s, model_path)
    roles = build_roles(s, model_path)
    agents = partial = None  # not an agent job; every step generates its own batch to the end
    if not t.rollout_ranks:  # this rank's rollout engine, and what runs on it besides the loop's own episodes
        rollout = make_rollout(r, model_path, p.rollout, t.seed, cfg.model.trust_remote_code, p.lm_head_fp32)
        mt = r.multi_turn
        if s.agent is not None:  # an agent job's episodes; their endpoint starts at the first collect
            agents = AgentEpisodes(
                s.agent,
                rollout,
                data.codec,
                r.max_model_len,
                mt.agent_timeout_s,
                parse_hermes_tool_calls,
                max_failure_fraction=mt.max_agent_failure_fraction,
            )
        if r.partial.enabled:  # a pool of partial rollouts, drawing this rank's next prompts
            b = t.prompts_per_step // s.world
            limits = PartialLimits(
                groups_per_step=b,
                max_staleness=r.partial.max_staleness,
                in_flight=math.ceil(b * (1 + r.partial.over_provision)),
                chunk_tokens=r.partial.chunk_tokens or max(1, r.max_new_tokens // 4),
                tail_fraction=r.partial.tail_fraction,
            )
            draw = functools.partial(data.sampler.draw, t.prompts_per_step, s.rank, s.world)
            partial = (
                PartialAgents(rollout, limits, data.prompts, draw, r.sampling, t.seed, agents)
                if agents is not None
                else PartialRollouts(rollout, limits, data.prompts, draw, r.sampling, t.seed, data.episode_spec)
            )
    else:  # apart (no agent jobs, no partial rollouts: the config refuses them), the stream from this rank's
        # rollout rank, which trainer rank 0 tells what to serve
        handshake = {
            "model_path": model_path,
            "engine": r.engine,
            "enforce_eager": r.enforce_eager,
            "rollout_dtype": p.rollout,
            "actor_dtype": p.actor,
            "lm_head_fp32": p.lm_head_fp32,
            "batch_invariant": p.batch_invariant,
            "prompts": data.prompts,
            "val_prompts": data.val_prompts,
            "trainers": s.world,
            "start": s.resume_step,  # a resumed run's stream starts after the checkpoint's step (its rows are in it)
        }
        rollout = RemoteRollout(bridge(), s.rank, data.tokenizer.pad_token_id, t.steps).connect(handshake)
    rewards = Rewards(cfg, s.reward_fn, roles.get("reward"), data.tokenizer, s.rank)
    probe = SyncProbe(data.prompts, t.seed, r.temperature, p.actor, p.rollout)
    step_metrics = StepMetrics(a, roles, rollout, data.sampler)
    kl_ctl = (
        algos.AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon)
        if a.kl_target
        else algos.FixedKLController(a.kl_coef)
    )
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
    prompts, val_prompts = (tokenize_prompts(x, codec, d.max_prompt_length) for x in (train, val))
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
