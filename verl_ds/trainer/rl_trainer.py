"""The RL loop: PPO (GAE + critic), GRPO, Dr.GRPO, RLOO, REINFORCE++ on per-role DeepSpeed engines.

`RLTrainer.step()` reads top to bottom as the data flow of one step (see docs/ARCHITECTURE.md). It is the only
place that knows every role; each phase is one call into the layer that owns it: rewards
(`trainer/rewards.py`), the sync's probe (`probe.py`), validation (`validation.py`), the step's metrics
(`metrics.py`), sample tables (`samples.py`), checkpoints and the export (`verl_ds/checkpoint.py`).
"""

from __future__ import annotations

import logging
import random
from dataclasses import asdict
from pathlib import Path

import torch

from verl_ds import algos
from verl_ds.checkpoint import export_actor
from verl_ds.config import RunConfig
from verl_ds.diagnostics.memory import MemoryTimer
from verl_ds.diagnostics.metrics import MetricsLogger, Timer
from verl_ds.diagnostics.observers import TrainerObserver
from verl_ds.diagnostics.plots import plot_curves
from verl_ds.diagnostics.progress import Progress
from verl_ds.dist import all_reduce_sum
from verl_ds.gemm import fp32_gemm
from verl_ds.process import release_free_memory
from verl_ds.roles import forget_destroyed_world, iter_full_params
from verl_ds.roles.batch import TrainBatch
from verl_ds.rollout import RolloutBatch, episodes, sync_distributed
from verl_ds.rollout.episodes import Sampling, SeedKey
from verl_ds.trainer import advantages, builder, consistency, validation
from verl_ds.trainer.groups import Collected, collect_varied, join_sequence_group, scoring_inputs
from verl_ds.trainer.samples import sample_rows
from verl_ds.trainer.setup import resolve_setup
from verl_ds.trainer.update import mini_batches, ppo_update

log = logging.getLogger(__name__)


class RLTrainer:
    """`with RLTrainer(cfg) as t: t.fit()` — or call `close()` (logger, vLLM) yourself.

    Past ~300 lines because it is the run's one timeline: start-up, the step read top to bottom,
    resume, validation and close. Each phase's work lives with its owner under trainer/ (rewards,
    the probe, metrics, samples, the update, checkpoints); what stays here is the order they run in."""

    track_activations = False  # `debug memory` sets it: also measure saved-for-backward bytes

    def __init__(self, cfg: RunConfig, reward_fn=None):
        _import_heavy_libraries()
        self.rollout = self.logger = self.agents = self.partial = None
        # the process group and every fact the run derives from its config, derived once (trainer/setup.py)
        self.setup = s = resolve_setup(cfg, reward_fn)
        self.cfg = cfg = s.cfg  # rollout.engine resolved
        self.rank, self.world, self.precision = s.rank, s.world, s.precision
        self.run_dir = Path(cfg.trainer.run_dir)
        # where this rank is, for the launcher to name if the rank dies by a signal (the OOM killer)
        resumed = str(s.resume_from) if s.resume_from is not None else None
        self.progress = Progress(self.rank, str(self.run_dir), dict(s.memory_estimate), s.rank_memory, resumed)
        parts = builder.build(s)  # every part, once (trainer/builder.py)
        self.model_path, self.roles, self.rollout = parts.model_path, parts.roles, parts.rollout
        d = parts.data
        self.tokenizer, self.codec, self.episode_spec = d.tokenizer, d.codec, d.episode_spec
        self.prompts, self.val_prompts, self.sampler = d.prompts, d.val_prompts, d.sampler
        self.actor, self.critic = self.roles["actor"], self.roles.get("critic")
        self.reference = self.roles.get("reference")
        self.teacher = self.roles.get("teacher")  # on-policy distillation (algorithm.distill)
        self.rewards, self.probe, self.step_metrics = parts.rewards, parts.probe, parts.step_metrics
        self.agents, self.partial, self.state = parts.agents, parts.partial, parts.state
        self.kl_ctl = self.state.kl_ctl
        self.estimator = algos.get_advantage_estimator(cfg.algorithm.estimator)
        self.buffer_dtype = self.precision.torch_dtype("buffer")
        # vLLM seeds the global RNG when it starts: seed this rank's own stream after it
        torch.manual_seed(cfg.trainer.seed + self.rank)
        random.seed(cfg.trainer.seed + self.rank)
        self.global_step = 0
        self.observers: list[TrainerObserver] = []  # diagnostics and tests watch the loop through these
        if s.resume_from is not None:  # roles, RNG, sampler and step from the checkpoint
            self._resume(s.resume_from)
        # metrics past the checkpoint's step are dropped (a fresh run: all of them)
        kept = self.global_step if s.resume_from is not None else -1
        self.logger = MetricsLogger(self.run_dir, cfg.logging.wandb, asdict(cfg), kept, enabled=self.rank == 0)

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[str, float]:
        """One PPO step; 16-bit GEMMs as `precision.cpu_gemm` resolved (verl_ds/gemm.py)."""
        with fp32_gemm(self.precision.fp32_gemm):
            return self._step()

    def _step(self) -> dict[str, float]:
        cfg = self.cfg
        timer = self._timer()
        for role in self.roles.values():
            role.take_token_counts()  # this step's passes only (validation also scores)
        with timer("step"):
            # 1-3. prompts -> rollout -> rewards (+ overlong shaping); with dynamic sampling, more
            # rounds until enough groups whose samples did not all score alike
            got = self._collect(timer)
            if self.actor.sp:  # a sequence-parallel group trains on its ranks' rows together, each split
                got = join_sequence_group(got, self.actor.sp)
            # the last sync's check: the step's own rows (below), or a probe sampled while the engine is
            # awake (none before the first sync)
            probe = self.probe.sample(self.rollout) if self.global_step and self.setup.sync_check == "probe" else None
            # GPU: vLLM's memory to the roles; the sync replaces the weights, so they are discarded
            # (level 2), not copied to the host and back
            self.rollout.sleep(level=2)
            self._wake_roles()  # roles.<role>.sleep: their states come back from the host
            # a weight the last sync did not land stops the run here
            probe_metrics = self.probe.check(probe, self.actor, self.global_step) if probe else {}
            scores = self.rewards.normalize(got.shaped)
            # 4. old, reference and teacher logprobs and values, stored in the buffer dtype
            n_minis = self._mini_batches(len(got.batch))
            stored, old_lp = self._score_pass(got.batch, timer, on_policy=self._first_is_old(n_minis))
            if self.global_step and self.setup.sync_check == "stream":  # the rollout rank's probe on the
                # weights it took: it came while these scored; a weight that did not land stops the run here
                probe_metrics = self.probe.check(self.probe.sample(self.rollout), self.actor, self.global_step)
            # or the sync checked on the actor's first scoring of these rows, before any optimizer step:
            # the old policy's pass, or (on-policy) the update's first forward
            check = self._row_check(got.batch, probe_metrics)
            if check and old_lp is not None:
                check(old_lp)
            alone = self._score_alone(stored, timer)  # the trainer against itself, some steps
            # 5-6. per-token rewards (KL in the reward, or none) and advantages (fp32)
            train = self._advantages(stored, scores, got.batch, timer)
            for o in self.observers:
                o.on_train_batch(self, train)
            # 7. ppo_epochs over mini-batches for the actor and the critic
            update_metrics, first_lp = self._update(train, timer, n_minis, check if train.on_policy else None)
            if train.on_policy:  # the first epoch's forward was the old policy: its logprobs
                old_lp, stored = first_lp, stored.replace(old_logprobs=self._buffered(first_lp), on_policy=False)
            if alone is not None:  # those rows as the step's first scoring ran them, against each alone
                update_metrics.update(consistency.against_itself(old_lp, alone, stored.loss_mask, cfg.algorithm))
            # 8. the new actor weights into the rollout engine
            with timer("update_weights", stage="sync", role="actor"):
                sync_metrics = sync_distributed(self.rollout, iter_full_params(self.actor.engine))
            sync_metrics.update(probe_metrics)
            self._sleep_roles()  # the next generation gets their device memory
        if not self.setup.gpu:  # the step's transient host memory back to the kernel: the floor holds
            release_free_memory()
            if isinstance(timer, MemoryTimer):
                timer.floor()
        self.global_step += 1
        # 9. metrics (reduced over ranks; rank 0 writes them); the adaptive KL controller takes this step's KL
        kl = self._kl_update(stored)
        metrics = self.step_metrics(got, stored, scores, old_lp, kl, {**update_metrics, **sync_metrics}, timer)
        if validation.due(cfg, self.global_step, bool(self.val_prompts)):
            metrics.update(self.validate())
        self.logger.log(metrics, self.global_step)
        self.setup.gate.check(metrics, self.global_step)  # past its bound: one line, or the run's end
        if cfg.logging.sample_every and self.global_step % cfg.logging.sample_every == 0:
            self.logger.log_samples(sample_rows(self.tokenizer, got.batch, got.examples, got.raw), self.global_step)
        return metrics

    # ------------------------------------------------------------------ phases
    def _timer(self) -> Timer:
        """A Timer that, every logging.memory_every steps, also accounts each role's memory per stage."""
        every = self.cfg.logging.memory_every

        def at(name: str, stage: str | None) -> None:
            self.progress.at(self.global_step + 1, name, stage)

        if self.track_activations or (every and self.global_step % every == 0):
            return MemoryTimer({**self.roles, "rollout": self.rollout}, self.track_activations, on_phase=at)
        return Timer(on_phase=at)

    def _row_check(self, batch: RolloutBatch, into: dict):
        """The last sync's check on this step's rows (`SyncProbe.check_rows`), its metrics into `into`;
        None where the probe checks (`setup.sync_check`) or no sync came before."""
        if not self.global_step or self.setup.sync_check != "rows":
            return None
        return lambda logprobs: into.update(self.probe.check_rows(logprobs, batch, self.global_step))

    def _score_alone(self, stored: TrainBatch, timer: Timer) -> consistency.Alone | None:
        """Every `logging.consistency_every` steps, a few rows scored again, each alone, on the weights
        the step's first scoring runs on (`trainer_corr/`); None on other steps and under SP (a row
        runs alone there already)."""
        every = self.cfg.logging.consistency_every
        if not every or self.global_step % every or self.actor.sp:
            return None
        with timer("consistency", stage="score", role="actor"):
            return consistency.score_alone(self.actor, stored, self.setup.sampled)

    def _first_is_old(self, n_minis: int) -> bool:
        """One mini-batch per epoch (and KL as a loss): the first epoch's forward runs on the very
        weights that generated the batch, so it is the old policy (ratio 1, exact) and no separate
        pass runs. A KL in the reward, or a distillation reward, needs the old logprobs before the
        advantages: a pass of their own."""
        a = self.cfg.algorithm
        distill_reward = self.teacher is not None and a.distill.mode == "reward"
        return n_minis == 1 and (a.use_kl_loss or not self.reference) and not distill_reward

    def _score_pass(self, batch: RolloutBatch, timer: Timer, on_policy: bool) -> tuple[TrainBatch, torch.Tensor | None]:
        """Every frozen view of the batch the update and the advantages read, each stored in the buffer
        dtype: (the train batch without advantages, the old logprobs in fp32 for the rollout-vs-trainer
        metrics; None when `on_policy`: the update's first forward computes them)."""
        data, t = scoring_inputs(batch), self.setup.sampled
        old_lp = None
        if not on_policy:
            with timer("old_logprob", stage="score", role="actor"):
                old_lp = self.actor.logprobs(data, t).cpu()
        with timer("ref", stage="score", role="reference"):
            ref_lp = self.reference.logprobs(data, t).cpu() if self.reference else None
        with timer("teacher", stage="score", role="teacher"):
            teacher_lp = self.teacher.logprobs(data, t).cpu() if self.teacher else None
        with timer("values", stage="score", role="critic"):
            values = self.critic.values(data).cpu() if self.critic else None
        stored = data.replace(
            old_logprobs=self._buffered(old_lp),
            ref_logprobs=self._buffered(ref_lp),
            teacher_logprobs=self._buffered(teacher_lp),
            old_values=self._buffered(values),
            rollout_logprobs=self._buffered(batch.rollout_logprobs),
            on_policy=on_policy,
        )
        return stored, old_lp

    def _advantages(self, stored: TrainBatch, scores: torch.Tensor, batch: RolloutBatch, timer: Timer) -> TrainBatch:
        """`stored` with each token's advantage and return (`trainer/advantages.py`)."""
        a = self.cfg.algorithm
        distill = a.distill if self.teacher else None
        return advantages.compute(stored, scores, batch, a, self.estimator, self.kl_ctl.value, distill, timer)

    def _collect(self, timer) -> Collected:
        """Rollout and rewards for this rank's prompts: one round, or, with `algorithm.filter_groups`,
        rounds until enough groups whose samples did not all score alike (`groups.collect_varied`)."""
        cfg, r = self.cfg, self.cfg.rollout
        sampling = r.sampling

        def one_round(round_: int) -> Collected:
            with timer("gen", stage="rollout", role="rollout"):
                if self.partial is not None:  # the groups that finished first, from the pool in flight
                    ro, examples = self.partial.collect(self.global_step)
                else:
                    examples = [self.prompts[i] for i in self._draw()]
                    ro = self._episodes(examples, sampling, SeedKey(cfg.trainer.seed, self.global_step, round_))
            with timer("reward", stage="score", role="reward"):
                raw = self.rewards.score(ro, examples)
                got = Collected(ro.batch, examples, raw, raw + self.rewards.overlong(ro.batch), ro.metrics)
            for o in self.observers:
                o.on_rollout(self, ro, raw)
            return got

        fg = cfg.algorithm.filter_groups
        return collect_varied(one_round, fg, cfg.trainer.prompts_per_step, self.world) if fg.enabled else one_round(0)

    def validate(self) -> dict[str, float]:
        """Held-out prompts on the rollout engine with the current weights (`trainer/validation.py`);
        rank 0 logs a table of greedy samples. Collective: every rank calls it."""
        mine = self.val_prompts[self.rank :: self.world]
        with fp32_gemm(self.precision.fp32_gemm):
            out, rows = validation.validate(
                self.cfg,
                mine,
                self.global_step,
                self._episodes,
                self.rewards.score,
                self.rollout,
                self.tokenizer,
                samples=self.rank == 0,
            )
        if rows:
            self.logger.log_samples(rows, self.global_step, key="val_samples")
        return out

    def _draw(self) -> list[int]:
        """This rank's share of the next `prompts_per_step` prompts (indices into `self.prompts`)."""
        return self.sampler.draw(self.cfg.trainer.prompts_per_step, self.rank, self.world)

    def _episodes(self, examples: list[dict], sampling: Sampling, seed: SeedKey) -> episodes.Rollout:
        """This rank's episodes of `examples`: the user's agent against the endpoint, or the loop's
        own (single-turn, or an environment's turns), here or, apart, on its rollout rank."""
        if self.agents is not None:
            return self.agents.collect(examples, sampling, seed)
        if self.cfg.trainer.rollout_ranks:  # its rollout rank ran them (trainer/rollout_rank.py)
            return episodes.collect_remote(self.rollout, examples, sampling, seed)
        ids = [e["prompt_ids"] for e in examples]
        return episodes.collect(self.rollout, examples, ids, sampling, seed, self.episode_spec)

    def _buffered(self, t):
        """The rollout buffer keeps logprobs/values in `buffer_dtype`; the math upcasts to fp32."""
        return None if t is None else t.to(self.buffer_dtype).float()

    def _mini_batches(self, n: int) -> int:
        """Mini-batches per epoch, the same on every rank (`update.mini_batches`). Collective."""
        return mini_batches(n, self.setup.mini_rows or n)

    def _kl_update(self, stored: TrainBatch) -> tuple[float, float]:
        """This step's KL to the reference (mean over every rank's tokens) into the KL controller ->
        (the KL, the coefficient the controller holds after it)."""
        mask = stored.loss_mask
        kl = advantages.kl_to_reference(stored.old_logprobs, stored.ref_logprobs, mask, self.cfg.algorithm)
        kl_sum, n_tok, n_seq = all_reduce_sum([float((kl * mask).sum()), float(mask.sum()), float(len(stored))])
        kl_mean = kl_sum / max(n_tok, 1.0)
        self.kl_ctl.update(kl_mean, n_steps=int(n_seq))  # same value on every rank
        return kl_mean, float(self.kl_ctl.value)

    def _update(
        self, train: TrainBatch, timer: Timer, n_minis: int, first_check=None
    ) -> tuple[dict, torch.Tensor | None]:
        """`ppo_epochs` over `n_minis` mini-batches of the actor and the critic (`update.ppo_update`)."""
        n = len(train)
        epochs, mini = self.cfg.algorithm.ppo_epochs, self.setup.mini_rows or n
        return ppo_update(self.actor, self.critic, train, timer, epochs, mini, n_minis, self._buffered, first_check)

    # ------------------------------------------------------------------ checkpoints
    def _sleep_roles(self) -> None:
        """`roles.<role>.sleep`: trained roles' states to host memory until `_wake_roles` (GPU)."""
        for name, role in self._trained_roles().items():
            if getattr(self.cfg.roles, name).sleep:
                role.sleep()

    def _wake_roles(self) -> None:
        for role in self._trained_roles().values():
            role.wake()

    def _trained_roles(self) -> dict:
        return {k: v for k, v in self.roles.items() if v.trainable}

    def save(self) -> Path:
        self._wake_roles()  # a checkpoint reads every state where the engine keeps it
        path = self.state.save(
            self.run_dir / "checkpoints", self.global_step, self._trained_roles(), self.cfg.checkpoint.keep_last
        )
        self._sleep_roles()
        self.progress.checkpoint(str(path))
        return path

    def _resume(self, path: Path) -> None:
        """Continue from checkpoint `path` (`setup.resume_from`: checked whole before any engine was
        built): the trained roles, this rank's RNG, the loop's state (`LoopState`) and the step."""
        self.global_step = self.state.load(path, self._trained_roles())
        sync_distributed(self.rollout, iter_full_params(self.actor.engine))  # the engine started from step 0
        if self.rank == 0:
            log.info("resumed from %s at step %d", path, self.global_step)

    def export(self, out_dir: Path, dtype: str) -> None:
        """The actor as an HF model (safetensors) in `dtype`, written atomically."""
        self._wake_roles()
        adapter = bool(self.cfg.model.lora.rank) and self.cfg.checkpoint.export == "adapter"
        export_actor(self.actor.engine, out_dir, dtype, self.tokenizer, adapter, self.run_dir)

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        from tqdm import tqdm

        cfg = self.cfg
        metrics: dict[str, float] = {}
        bar = tqdm(total=cfg.trainer.steps, initial=self.global_step, disable=self.rank != 0, desc="train")
        try:  # the bar ends its line whatever ends the loop: an error's one line starts a line of its own
            if self.global_step == 0 and validation.due(cfg, 0, bool(self.val_prompts)):
                self.logger.log(self.validate(), 0)
            while self.global_step < cfg.trainer.steps:
                metrics = self.step()
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
                every = cfg.checkpoint.every
                if every and self.global_step % every == 0:
                    self.save()
            if not (cfg.checkpoint.every and self.global_step % cfg.checkpoint.every == 0):
                self.save()  # the final state, for resume and for the record
            self.export(self.run_dir / "final_model", cfg.checkpoint.export_dtype)
            if self.rank == 0:
                plot_curves(
                    self.logger.path,
                    self.run_dir / "reward_curve.png",
                    keys=("reward/mean", f"val/{cfg.data.task}/accuracy"),
                )
        finally:
            bar.close()
        return metrics

    # ------------------------------------------------------------------ teardown
    def close(self, exiting: bool = False) -> None:
        """Finish the W&B run and metrics file, shut down the rollout engine. Idempotent. `exiting`:
        the process ends next, so the engine's memory is left to the OS (no teardown)."""
        logger, rollout, self.logger, self.rollout = self.logger, self.rollout, None, None
        if logger is not None:
            logger.finish()
        partial, agents, self.partial, self.agents = self.partial, self.agents, None, None
        if partial is not None:  # the endpoints first: they generate on the engine
            partial.close()
        if agents is not None:
            agents.close()
        if rollout is not None:
            rollout.shutdown(release=not exiting)
            forget_destroyed_world()  # vLLM's teardown destroys the world group under DeepSpeed

    def __enter__(self) -> RLTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _import_heavy_libraries() -> None:
    """Every rank imports what it needs before the first barrier. Imported lazily, rank 0 paid for
    transformers while building the tiny model, and rank 1 only after the barrier while rank 0 waited
    at the next collective: the ranks took turns."""
    import deepspeed  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
