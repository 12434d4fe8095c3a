"""What a run checks of its config against its models' files before any engine exists, and the rollout
engine that resolves from them. `train` (`trainer/setup.py`) and `config render` run this one function,
so a render is the dry run of a start: every mistake at once, one line each, the same lines. (The
config's own rules, and the models' heads against the sequence-parallel size, are `config.validate`'s;
what needs this rank's memory, the world or the hardware is the setup's.)"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

from verl_ds.algos import TokenDist
from verl_ds.config import RunConfig, position_errors, sequence_parallel_says
from verl_ds.data.tiny import check_teacher_tokenizer, model_config, student_tokenizer
from verl_ds.diagnostics.memory import ModelShape
from verl_ds.errors import ConfigError, raise_all
from verl_ds.rollout import resolve_engine

log = logging.getLogger(__name__)


class Sampling(NamedTuple):
    """What `preflight` resolves: the engine the rollout samples with, the distribution it samples each
    token from, which every policy pass scores it under (`resolve_sampled`), and the policy's shape."""

    engine: str  # vllm | hf; `auto` where the model is not here (`config render` on another machine)
    dist: TokenDist
    shape: ModelShape | None  # the policy's, from its config.json (or the tiny one's); None: not here


def preflight(cfg: RunConfig, gpu: bool) -> Sampling:
    """How this run samples (`rollout.engine` resolved), after every check of the config against the
    models: a teacher's tokenizer the student's, rows within the policy's positions
    (`config.position_errors`). A model absent here is not checked (`validate_paths` names it). What
    sequence parallelism set is said here, once. (The models' files first, then the config's rules.)"""
    dist, errors, m = resolve_sampled(cfg), [], cfg.model
    c, engine = model_config(m), cfg.rollout.engine
    if m.teacher_path and Path(m.teacher_path).is_dir() and (student := student_tokenizer(m)) is not None:
        try:  # distillation compares the two models' logprobs of the same ids
            check_teacher_tokenizer(student, m.teacher_path, m.trust_remote_code)
        except ConfigError as e:
            errors.append(e)
    shape = None
    if c is not None:
        try:
            shape = ModelShape.from_hf_config(c)
        except (KeyError, TypeError) as e:
            errors.append(ConfigError(m.path, f"not a decoder config.json this estimate understands ({e})"))
    if shape is not None:
        try:
            # SP splits the actor's attention; apart, the engine runs on a rollout rank with a model of its own
            sp = 1 if cfg.trainer.rollout_ranks else cfg.trainer.sequence_parallel_size
            engine = resolve_engine(cfg.rollout, shape.params("lm"), gpu, sp)
        except ConfigError as e:
            errors.append(e)
    if said := sequence_parallel_says(cfg):
        log.info(said)
    if c is not None:
        where = "model.tiny.max_positions" if m.path == "tiny" else f"max_position_embeddings in {m.path}/config.json"
        errors += position_errors(cfg, c, where, engine)
    raise_all(errors)
    return Sampling(engine, dist, shape)


def resolve_sampled(cfg: RunConfig) -> TokenDist:
    """The distribution the rollout samples from (`algos.TokenDist`), which every policy pass scores
    its tokens under; a truncated one said in one line, with where its kept set comes from."""
    r = cfg.rollout
    dist = TokenDist(r.temperature, r.top_k, r.top_p)
    if dist.truncates:
        log.info(
            "sampling: top_k %d, top_p %g: every pass scores a token under the renormalised set the rollout engine "
            "sampled it from, that set recomputed from the pass's own logits by the engine's rule (exact for a "
            "matched pair; vLLM's returned sampling mask needs its GPU model runner and is not read)",
            r.top_k,
            r.top_p,
        )
    return dist
