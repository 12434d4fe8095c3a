"""A rollout rank (`trainer.rollout_ranks` > 0): a rollout engine and nothing else, generating each
step's rows for the trainer ranks it serves while they train the step before.

The schedule is fixed, so a run is the same however fast either side is: the rows of step s are
sampled on the weights of step s - 1 (step 0 and 1 on the initial ones), one step off-policy. At step
s >= 2 the rank first takes the weights trainer rank 0 sent after its step s - 2 (in place, checked by
the engine's read-back), samples the sync's probe on them for the trainer ranks to score on the same
weights before their next optimizer step (`SyncProbe`: a weight that did not land stops the run
there), then generates step s. The trainers' own loop asks for exactly these rows, in this order
(`rollout.engines.remote.RemoteRollout`). The rank samples one step past the last (its engine would idle
through the last step anyway): the run's final checkpoint holds them, so training on from it is exact.

Validation after step v (`validation.due`; v = 0: before the first step) runs on the weights of step v,
so the rank generates it as soon as they land: at step 0 before any rows, else right after the probe of
step v + 1 and before its rows. The trainer ranks ask for it after step v, before the rows of step v + 1
they already have in the stream (`RemoteRollout` holds those until asked).

A run resumed from the checkpoint after step k (`start` = k) already holds the rows of step k (and has
validated step k); the rank skips the prompts drawn up to them and starts at step k + 1, on the
checkpoint's weights that the trainers' resume sends (in full: the rank holds none of them yet).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from verl_ds.config import RunConfig, resolve_names
from verl_ds.data.dataset import PromptSampler
from verl_ds.dist import peer_lost
from verl_ds.rollout import episodes, make_rollout
from verl_ds.rollout.engines.remote import apply_changes, as_message
from verl_ds.rollout.engines.vllm_internals import batch_invariant_kernels
from verl_ds.rollout.episodes import EpisodeSpec, Sampling, SeedKey
from verl_ds.trainer import validation
from verl_ds.trainer.builder import build_episodes
from verl_ds.trainer.probe import SyncProbe

log = logging.getLogger(__name__)


def serve(cfg: RunConfig, bridge) -> None:
    """Serve `cfg.trainer.steps` steps of rows to this rollout rank's trainer ranks (`Bridge.trainers_of`),
    then take the last weights and end; the trainer ranks gone first (one failed) ends it in one line."""
    try:
        _serve(cfg, bridge)
    except Exception as e:
        if not peer_lost(e):
            raise
        log.warning("rollout rank %d: the trainer ranks are gone (%s); ending", bridge.rank, type(e).__name__)


def _serve(cfg: RunConfig, bridge) -> None:
    hs = bridge.recv(0)  # trainer rank 0's handshake, once its model and prompts exist
    r, t = cfg.rollout, cfg.trainer
    rollout_cfg = replace(r, engine=hs["engine"], enforce_eager=hs["enforce_eager"])
    if hs["batch_invariant"]:  # the trainer ranks run them too (builder.build)
        batch_invariant_kernels()
    engine = make_rollout(
        rollout_cfg, hs["model_path"], hs["rollout_dtype"], t.seed, cfg.model.trust_remote_code, hs["lm_head_fp32"]
    )
    spec = _episode_spec(cfg, hs["model_path"])
    prompts, val_prompts, trainers, start = hs["prompts"], hs["val_prompts"], hs["trainers"], hs["start"]
    mine = bridge.trainers_of(bridge.rank)
    sampler = PromptSampler(len(prompts), cfg.data.seed, cfg.data.shuffle)
    probe = SyncProbe(prompts, t.seed, r.temperature, hs["actor_dtype"], hs["rollout_dtype"])
    held: dict = {}
    version, idle, synced = 0, 0.0, {}
    first = start + 1 if start else 0
    for _ in range(first):  # the steps the checkpoint's run drew its prompts for
        sampler.next(t.prompts_per_step)
    log.info("rollout rank %d: serving trainer ranks %s on %s from step %d", bridge.rank, mine, hs["engine"], first)
    for s in range(first, t.steps + 2):
        if s >= 2:  # the weights of step s - 1, in place, then the probe the trainers check them by
            t0 = time.perf_counter()
            msg = bridge.recv(0)
            idle += time.perf_counter() - t0
            for name, part in msg["tensors"].items():
                held[name] = apply_changes(held.get(name), part)
            synced = engine.sync_weights(iter(held.items()))
            version = msg["version"]
            if s <= t.steps:
                got = probe.sample(engine)
                args = dict(n=1, temperature=probe.temperature, top_p=1.0, max_new_tokens=probe.TOKENS, top_k=0)
                for trainer in mine:
                    idle += _send(bridge, trainer, probe.prompts, probe.seeds, args, got.batch, {}, "probe")
        v = s - 1 if s >= 2 else 0 if s == 0 else -1  # the step whose weights the engine holds first now
        if v >= 0 and (v > start or not start) and validation.due(cfg, v, bool(val_prompts)):
            for trainer in mine:
                idle += _validate(engine, bridge, cfg, v, val_prompts[trainer::trainers], spec, trainer, trainers)
        if s <= t.steps:
            picked = sampler.next(t.prompts_per_step)
            sampling = r.sampling
            key = SeedKey(t.seed, s, 0)
            for trainer in mine:
                examples = [prompts[i] for i in picked[trainer::trainers]]
                ro = _episodes(engine, examples, sampling, key, spec, trainer, trainers)
                metrics = {
                    **engine.last_metrics,
                    **{f"rollout_rank/{k.split('/')[-1]}": v for k, v in synced.items()},
                    "rollout/policy_lag": float(s - version),
                    "timing_s/rollout_idle": idle,
                }
                idle = _send_episodes(bridge, trainer, examples, sampling, key, ro, metrics, "rows")
    engine.shutdown()


def _episode_spec(cfg: RunConfig, model_path: str) -> EpisodeSpec | None:
    """A multi-turn job's episodes run on this rank: the environment, the codec and the turn limits the trainer
    ranks' builder makes from the same config (its names resolved there first: a bad one was refused there)."""
    if not cfg.rollout.multi_turn.enabled:
        return None
    names, _ = resolve_names(cfg)
    return build_episodes(cfg, model_path, names.tools, names.env_factory)[2]


def _episodes(engine, examples: list[dict], sampling: Sampling, key: SeedKey, spec, trainer: int, trainers: int):
    """`trainer`'s episodes of `examples` as its own loop would run them (`episodes.collect` at its prompt
    positions): single-turn rows, or an environment's turns on this rank."""
    ids = [e["prompt_ids"] for e in examples]
    return episodes.collect(engine, examples, ids, sampling, key, spec, at=(trainer, trainers))


def _validate(
    engine, bridge, cfg: RunConfig, step: int, examples: list[dict], spec, trainer: int, trainers: int
) -> float:
    """Validation after `step` for `trainer` on its share `examples` of the held-out prompts: the episodes
    `validation.validate` asks for there, run as its loop runs them; -> seconds waited."""
    waited = 0.0
    for sampling, key in validation.requests(cfg, step):
        ro = _episodes(engine, examples, sampling, key, spec, trainer, trainers)
        waited += _send_episodes(bridge, trainer, examples, sampling, key, ro, {}, "val")
    return waited


def _send_episodes(bridge, trainer: int, examples, sampling: Sampling, key: SeedKey, ro, metrics: dict, kind: str):
    """Episodes to `trainer`, with what they answer (`episodes.asked_for`) and what they are (`kind`: rows | val);
    -> the seconds this rank waited for it to take them."""
    t0 = time.perf_counter()
    asked = episodes.asked_for([e["prompt_ids"] for e in examples], sampling, key)
    bridge.send({"kind": kind, "asked": asked, **ro.to_message(), "metrics": metrics}, trainer)
    return time.perf_counter() - t0


def _send(bridge, trainer: int, prompts, seeds, args: dict, batch, metrics: dict, kind: str) -> float:
    """The sync probe's rows to `trainer`, with what they answer (`asked`, as `RemoteRollout.generate` asks);
    -> the seconds this rank waited for it to take them."""
    t0 = time.perf_counter()
    asked = dict(prompts=[list(p) for p in prompts], **args, seeds=list(seeds))
    asked = {k: asked[k] for k in ("prompts", "n", "temperature", "top_p", "max_new_tokens", "seeds", "top_k")}
    bridge.send({"kind": kind, "asked": asked, "batch": as_message(batch), "metrics": metrics}, trainer)
    return time.perf_counter() - t0
