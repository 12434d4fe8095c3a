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
from verl_ds.config import RunConfig, longest_row, sequence_parallel_says
from verl_ds.data.tiny import check_teacher_tokenizer, model_config, student_tokenizer
from verl_ds.diagnostics.memory import ModelShape
from verl_ds.errors import ConfigError, raise_all
from verl_ds.rollout import resolve_engine

log = logging.getLogger(__name__)


class Sampling(NamedTuple):
    """What `preflight` resolves: the engine the rollout samples with, and the distribution it samples
    each token from, which every policy pass scores it under (`resolve_sampled`)."""

    engine: str  # vllm | hf; `auto` where the model is not here (`config render` on another machine)
    dist: TokenDist


def preflight(cfg: RunConfig, gpu: bool) -> Sampling:
    """How this run samples (`rollout.engine` resolved), after every check of the config against the
    models: rows within the policy's positions, a teacher's tokenizer the student's. A model absent here is
    not checked (`validate_paths` names it). What sequence parallelism set is said here, once."""
    if said := sequence_parallel_says(cfg):
        log.info(said)
    errors: list[ConfigError] = []
    c, engine = model_config(cfg.model), cfg.rollout.engine
    if c is not None:
        try:
            params = ModelShape.from_hf_config(c).params("lm")
            engine = resolve_engine(cfg.rollout, params, gpu, cfg.trainer.sequence_parallel_size)
        except ConfigError as e:
            errors.append(e)
        errors += _positions(cfg, c, engine)
    m = cfg.model
    if m.teacher_path and Path(m.teacher_path).is_dir() and (student := student_tokenizer(m)) is not None:
        try:  # distillation compares the two models' logprobs of the same ids
            check_teacher_tokenizer(student, m.teacher_path, m.trust_remote_code)
        except ConfigError as e:
            errors.append(e)
    raise_all(errors)
    return Sampling(engine, resolve_sampled(cfg, engine))


def _positions(cfg: RunConfig, c: dict, engine: str) -> list[ConfigError]:
    """Rows past the model's positions, for every engine: vLLM refuses an engine whose `max_model_len`
    passes them (a traceback from its engine start, with nothing of the run's keys in it); HF generate
    would run on past the positions the model was trained on, silently. A model whose config scales its
    rotary embeddings is left to its engine; `auto` not resolved (no model here) is checked as vLLM."""
    limit = c.get("max_position_embeddings")
    if not isinstance(limit, int) or c.get("rope_scaling"):
        return []
    m, r, mt = cfg.model, cfg.rollout, cfg.rollout.multi_turn
    where = "model.tiny.max_positions" if m.path == "tiny" else f"max_position_embeddings in {m.path}/config.json"
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


def resolve_sampled(cfg: RunConfig, engine: str) -> TokenDist:
    """The distribution the rollout samples from (`algos.TokenDist`), which every policy pass scores
    its tokens under; a truncated one said in one line, with where its kept set comes from."""
    r = cfg.rollout
    dist = TokenDist(r.temperature, r.top_k, r.top_p)
    if dist.truncates:
        log.info(
            "sampling: top_k %d, top_p %g: every pass scores a token under the renormalised set the %s engine "
            "sampled it from, that set recomputed from the pass's own logits by the engine's rule (exact for a "
            "matched pair; vLLM's returned sampling mask needs its GPU model runner and is not read)",
            r.top_k,
            r.top_p,
            engine,
        )
    return dist
