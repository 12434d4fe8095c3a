"""The RL loop: PPO (GAE + critic), GRPO, Dr.GRPO, RLOO, REINFORCE++ on per-role DeepSpeed engines.

`RLTrainer.step()` reads top to bottom as the data flow of one step (see docs/ARCHITECTURE.md). It is the only
place that knows every role; each phase is one call into the layer that owns it.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from verl_ds import algos
from verl_ds.config import RunConfig
from verl_ds.data.reward import call_reward
from verl_ds.diagnostics.memory import MemoryTimer
from verl_ds.diagnostics.metrics import MetricsLogger, Timer, reduce_metrics
from verl_ds.diagnostics.observers import TrainerObserver
from verl_ds.diagnostics.plots import plot_curves
from verl_ds.diagnostics.progress import Progress
from verl_ds.dist import all_gather_object, all_reduce_max, all_reduce_min, all_reduce_sum
from verl_ds.errors import RunFailure
from verl_ds.gemm import fp32_gemm
from verl_ds.process import release_free_memory
from verl_ds.roles import align_overflow, forget_destroyed_world, iter_full_params
from verl_ds.roles.batch import TrainBatch
from verl_ds.roles.params import export_adapter, export_hf
from verl_ds.rollout import RolloutBatch, episodes, make_rollout, sync_distributed
from verl_ds.rollout.episodes import Sampling, SeedKey
from verl_ds.trainer import builder
from verl_ds.trainer.checkpoint import last_good, load_checkpoint, save_checkpoint
from verl_ds.trainer.groups import Collected, varied_groups
from verl_ds.trainer.setup import resolve_setup

log = logging.getLogger(__name__)


class RLTrainer:
    """`with RLTrainer(cfg) as t: t.fit()` — or call `close()` (logger, vLLM) yourself."""

    track_activations = False  # `debug memory` sets it: also measure saved-for-backward bytes

    def __init__(self, cfg: RunConfig, reward_fn=None):
        _import_heavy_libraries()
        self.rollout = self.logger = self.agents = self.partial = None
        # the process group and every fact the run derives from its config, derived once (trainer/setup.py)
        self.setup = s = resolve_setup(cfg, reward_fn)
        self.cfg = cfg = s.cfg  # rollout.engine resolved
        self.rank, self.world, self.precision, self.model_path = s.rank, s.world, s.precision, s.model_path
        self.run_dir = Path(cfg.trainer.run_dir)
        # where this rank is, for the launcher to name if the rank dies by a signal (the OOM killer)
        self.progress = Progress(self.rank, str(self.run_dir), dict(s.memory_estimate), s.rank_memory)
        self.reward_fn = s.reward_fn
        data = builder.build_data(s)  # the tokenizer, codec, episodes, prompts and their sampler
        self.tokenizer, self.codec, self.episode_spec = data.tokenizer, data.codec, data.episode_spec
        self.prompts, self.val_prompts, self.sampler = data.prompts, data.val_prompts, data.sampler
        self.roles = builder.build_roles(s)
        self.actor, self.critic = self.roles["actor"], self.roles.get("critic")
        self.reference, self.reward_model = self.roles.get("reference"), self.roles.get("reward")
        self.teacher = self.roles.get("teacher")  # on-policy distillation (algorithm.distill)
        self.estimator = algos.get_advantage_estimator(cfg.algorithm.estimator)
        a = cfg.algorithm
        self.kl_ctl = (
            algos.AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon)
            if a.kl_target
            else algos.FixedKLController(a.kl_coef)
        )
        self.reward_stats = algos.RunningMeanStd()
        self.buffer_dtype = self.precision.torch_dtype("buffer")
        self.rollout = make_rollout(
            cfg.rollout,
            self.model_path,
            self.precision.rollout,
            cfg.trainer.seed,
            trust_remote_code=cfg.model.trust_remote_code,
            lm_head_fp32=self.precision.lm_head_fp32,
        )
        self.agents = builder.build_agents(s, self.codec, self.rollout)  # None: not an agent job
        # None: each step generates its own batch to the end; else groups stay in flight across steps
        self.partial = builder.build_partial(s, self.rollout, self.prompts, self._draw, self.episode_spec, self.agents)
        # vLLM seeds the global RNG when it starts: seed this rank's own stream after it
        torch.manual_seed(cfg.trainer.seed + self.rank)
        random.seed(cfg.trainer.seed + self.rank)
        self.global_step = 0
        self.observers: list[TrainerObserver] = []  # diagnostics and tests watch the loop through these
        if s.resume_from is not None:  # roles, RNG, sampler and step from the checkpoint
            self._resume(s.resume_from)
        self.logger = MetricsLogger(self.run_dir, cfg.logging.wandb, asdict(cfg), enabled=self.rank == 0)
        self.logger.rewind(self.global_step if s.resume_from is not None else -1)  # metrics past it are dropped

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
            probe = self._probe_sample()  # the last sync's probe, while the engine is awake (none before it)
            # GPU: vLLM's memory to the roles; the sync replaces the weights, so they are discarded
            # (level 2), not copied to the host and back
            self.rollout.sleep(level=2)
            self._wake_roles()  # roles.<role>.sleep: their states come back from the host
            probe_metrics = self._probe_check(probe)  # a weight the last sync did not land stops the run here
            scores = self._normalize(got.shaped)
            # 4. old, reference and teacher logprobs and values, stored in the buffer dtype
            n_minis = self._mini_batches(len(got.batch))
            stored, old_lp = self._score_pass(got.batch, timer, on_policy=self._first_is_old(n_minis))
            # 5-6. per-token rewards (KL in the reward, or none) and advantages (fp32)
            train = self._advantages(stored, scores, got.batch, timer)
            for o in self.observers:
                o.on_train_batch(self, train)
            # 7. ppo_epochs over mini-batches for the actor and the critic
            update_metrics, first_lp = self._update(train, timer, n_minis)
            if train.on_policy:  # the first epoch's forward was the old policy: its logprobs
                old_lp, stored = first_lp, stored.replace(old_logprobs=self._buffered(first_lp), on_policy=False)
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
        # 9. metrics (reduced over ranks; rank 0 writes them)
        metrics = self._step_metrics(got, stored, scores, old_lp, update_metrics, sync_metrics, timer)
        if self.val_prompts and cfg.trainer.val_every and self.global_step % cfg.trainer.val_every == 0:
            metrics.update(self.validate())
        self.logger.log(metrics, self.global_step)
        if cfg.logging.sample_every and self.global_step % cfg.logging.sample_every == 0:
            self._log_samples(got.batch, got.examples, got.raw)
        return metrics

    # ------------------------------------------------------------------ phases
    PROBE_PROMPTS, PROBE_PROMPT_TOKENS, PROBE_TOKENS = 2, 32, 4  # one engine call, a few ms of scoring

    def _probe_sample(self):
        """After a sync, the engine samples a fixed probe (the first training prompts, a fixed seed), at the
        next step's generation while the engine is awake; `_probe_check` has the actor score it once the
        roles are awake (on a GPU the two never hold the device at once). None before the first sync."""
        if self.global_step == 0:
            return None
        t0 = time.perf_counter()
        prompts = [list(p["prompt_ids"])[-self.PROBE_PROMPT_TOKENS :] for p in self.prompts[: self.PROBE_PROMPTS]]
        seeds = [self.cfg.trainer.seed + i for i in range(len(prompts))]
        ro = self.rollout.generate(prompts, 1, self.cfg.rollout.temperature, 1.0, self.PROBE_TOKENS, seeds=seeds)
        return ro, time.perf_counter() - t0

    def _probe_check(self, probe) -> dict[str, float]:
        """The actor's logprobs of the probe's tokens on the weights it synced against the engine's: they
        differ by the two formats' rounding (`algos.probe_bound`), or a weight did not land (one the sync's
        read-back cannot see: the CPU backend repacks linear weights, fused q/k/v and gate/up have no
        checkpoint name). Past the bound the run stops in one line, before this step trains. Collective:
        every rank scores the same probe."""
        if probe is None:
            return {}
        ro, sample_s = probe
        t0 = time.perf_counter()
        mine = self.actor.logprobs(_inputs(ro), self.cfg.rollout.temperature).cpu()
        mask = ro.loss_mask
        gap = float(((mine - ro.rollout_logprobs).abs() * mask).sum() / mask.sum().clamp(min=1))
        p = self.precision
        bound = algos.probe_bound(p.actor, p.rollout)
        if not gap <= bound:
            raise RunFailure(
                f"weight sync {self.global_step}: the rollout engine's logprobs of a fixed probe are {gap:.3g} "
                f"from the actor's on the same tokens (mean over {int(mask.sum())}; at most {bound:.3g} for "
                f"{p.actor} vs {p.rollout}): a weight did not reach the engine"
            )
        return {"rollout/sync_probe_gap": gap, "timing_s/sync_probe": sample_s + time.perf_counter() - t0}

    def _timer(self) -> Timer:
        """A Timer that, every logging.memory_every steps, also accounts each role's memory per stage."""
        every = self.cfg.logging.memory_every

        def at(name: str, stage: str | None) -> None:
            self.progress.at(self.global_step + 1, name, stage)

        if self.track_activations or (every and self.global_step % every == 0):
            return MemoryTimer({**self.roles, "rollout": self.rollout}, self.track_activations, on_phase=at)
        return Timer(on_phase=at)

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
        data, t = _inputs(batch), self.cfg.rollout.temperature
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
        """The train batch: `stored` with each token's advantage and return. The score sits on the last
        model token, minus the KL to the reference when the KL is in the reward (classic PPO; GRPO-style
        runs put it in the loss); on-policy distillation adds the teacher's per-token reverse KL."""
        a, mask = self.cfg.algorithm, stored.loss_mask
        kl_in_reward = None
        if not a.use_kl_loss:
            kl_in_reward = self._kl(stored.old_logprobs, stored.ref_logprobs, mask) * self.kl_ctl.value
        token_rewards = _token_rewards(scores, mask, kl_in_reward)
        with timer("adv"):
            adv, returns = self.estimator(
                token_rewards=token_rewards,
                scores=token_rewards.sum(-1),
                values=stored.old_values,
                response_mask=mask,
                group_ids=batch.group_ids,
                gamma=a.gamma,
                lam=a.lam,
            )
            distill = a.distill if self.teacher else None
            if distill is not None:  # distillation alone, or added to the task's advantages
                if not distill.with_task_reward:
                    adv = returns = torch.zeros_like(adv)
                if distill.mode == "reward":  # each token's reward -coef * (log pi_s - log pi_t)
                    d_adv = algos.distill_advantages(
                        stored.old_logprobs, stored.teacher_logprobs, mask, distill.coef, distill.discount
                    )
                    adv, returns = adv + d_adv, returns + d_adv
        if a.mask_truncated:  # samples cut at max_new_tokens teach nothing about endings
            mask = mask * (1 - _truncated(batch))[:, None]
        return stored.replace(advantages=adv.float(), returns=returns.float(), loss_mask=mask)

    def _collect(self, timer) -> Collected:
        """Rollout and rewards for this rank's prompts. With `algorithm.filter_groups`, groups with zero
        variance on the chosen metric are dropped and more prompts are drawn until the step has
        `prompts_per_step` kept groups or `max_rounds` rounds ran; every rank then keeps the same
        number of groups."""
        cfg, r, fg = self.cfg, self.cfg.rollout, self.cfg.algorithm.filter_groups
        sampling = Sampling(r.n, r.temperature, r.top_p, r.max_new_tokens)
        parts, rounds, seen, dropped, drawn = [], 0, 0, 0, []
        while True:
            with timer("gen", stage="rollout", role="rollout"):
                if self.partial is not None:  # the groups that finished first, from the pool in flight
                    ro, examples = self.partial.collect(self.global_step)
                else:
                    examples = [self.prompts[i] for i in self._draw()]
                    ro = self._episodes(examples, sampling, SeedKey(cfg.trainer.seed, self.global_step, rounds))
            with timer("reward", stage="score", role="reward"):
                raw = self._score(ro, examples)
                got = Collected(ro.batch, examples, raw, raw + self._overlong(ro.batch), ro.metrics)
            for o in self.observers:
                o.on_rollout(self, ro, raw)
            rounds += 1
            if not fg.enabled:
                return got
            drawn.append(raw)
            keep = varied_groups(raw if fg.metric == "acc" else got.shaped, got.batch.group_ids, len(examples))
            seen, dropped = seen + len(examples), dropped + len(examples) - len(keep)
            parts.append(got.select_groups(keep))
            kept = all_reduce_sum([float(sum(len(p.examples) for p in parts))])[0]
            if kept >= cfg.trainer.prompts_per_step or rounds >= fg.max_rounds:
                break
        # the same number of groups on every rank (collectives and micro-batches must match)
        merged = Collected.merge(parts)
        k = int(all_reduce_min(float(min(len(merged.examples), cfg.trainer.prompts_per_step // self.world))))
        # nothing varied on some rank: train on the last round as drawn (its advantages are zero)
        out = merged.select_groups(list(range(k))) if k else got
        drawn = torch.cat(drawn)
        seen_all, dropped_all, drawn_sum, drawn_n = all_reduce_sum(
            [float(seen), float(dropped), float(drawn.sum()), float(len(drawn))]
        )
        return replace(
            out,
            metrics={
                **ro.metrics,
                "filter/kept_groups": float(k * self.world),
                "filter/rounds": float(rounds),
                "filter/zero_variance_fraction": dropped_all / max(seen_all, 1.0),
                "filter/reward_mean_drawn": drawn_sum / max(drawn_n, 1.0),  # before filtering
            },
        )

    def validate(self) -> dict[str, float]:
        """Held-out prompts on the rollout engine with the current weights: greedy accuracy (mean
        reward at temperature 0) and, from `trainer.val_n` samples at the rollout temperature,
        mean@k and unbiased pass@k (a sample passes with reward >= 1). Collective: every rank calls it."""
        with fp32_gemm(self.precision.fp32_gemm):
            return self._validate()

    def _validate(self) -> dict[str, float]:
        cfg, r = self.cfg, self.cfg.rollout
        k, name = cfg.trainer.val_n, cfg.data.task
        mine = self.val_prompts[self.rank :: self.world]
        tag = f"val{self.global_step}"  # seeds apart from every training step's
        greedy = self._episodes(mine, Sampling(1, 0.0, 1.0, r.max_new_tokens), SeedKey(cfg.trainer.seed, tag))
        sampled = self._episodes(
            mine, Sampling(k, r.temperature, r.top_p, r.max_new_tokens), SeedKey(cfg.trainer.seed, tag, round_=1)
        )
        # the next generation comes without a sync (the weights stay, on the host) and a checkpoint or
        # the export may wake the roles first
        self.rollout.sleep(level=1)
        acc = _per_episode(self._score(greedy, mine), greedy.episode)
        scores = (
            _per_episode(self._score(sampled, mine), sampled.episode).view(len(mine), k) if mine else torch.zeros(0, k)
        )
        passed = [algos.pass_at_k(k, int((row >= 1).sum()), k) for row in scores]
        tot = all_reduce_sum(
            [
                float(acc.sum()),
                float(scores.mean(-1).sum()) if mine else 0.0,
                sum(passed),
                float(greedy.batch.loss_mask.sum()),
                float(len(mine)),
            ]
        )
        n = max(tot[4], 1.0)
        if self.rank == 0 and mine:
            last_rows = [int((greedy.episode == e).nonzero()[-1]) for e in range(len(mine))]  # forks: the last
            texts = self._decode(greedy.batch.select(last_rows))
            rows = [(e["prompt"], text, float(s)) for e, text, s in zip(mine, texts, acc)][:16]
            self.logger.log_samples(rows, self.global_step, key="val_samples")
        out = {
            f"val/{name}/accuracy": tot[0] / n,
            f"val/{name}/mean@{k}": tot[1] / n,
            f"val/{name}/pass@{k}": tot[2] / n,
            "val/response_length/mean": tot[3] / n,
        }
        # multi-turn: the greedy episodes' turns and tool use (mean over ranks, as every metric)
        keep = ("tools/", "multi_turn/turns", "agent/calls", "agent/failures")
        out.update({f"val/{k}": v for k, v in greedy.metrics.items() if k.startswith(keep)})
        return out

    def _draw(self) -> list[int]:
        """This rank's share of the next `prompts_per_step` prompts (indices into `self.prompts`)."""
        return self.sampler.next(self.cfg.trainer.prompts_per_step)[self.rank :: self.world]

    def _episodes(self, examples: list[dict], sampling: Sampling, seed: SeedKey) -> episodes.Rollout:
        """This rank's episodes of `examples`: the user's agent against the endpoint, or the loop's
        own (single-turn, or an environment's turns)."""
        if self.agents is not None:
            return self.agents.collect(examples, sampling, seed)
        ids = [e["prompt_ids"] for e in examples]
        return episodes.collect(self.rollout, examples, ids, sampling, seed, self.episode_spec)

    def _overlong(self, batch) -> torch.Tensor:
        o, r = self.cfg.algorithm.overlong, self.cfg.rollout
        lengths = batch.loss_mask.sum(-1)
        return (
            algos.overlong_penalty(lengths, r.max_new_tokens, o.buffer_len, o.penalty)
            if o.buffer_len
            else torch.zeros_like(lengths)
        )

    def _score(self, ro: episodes.Rollout, examples) -> torch.Tensor:
        """Each row's score: the reward model's on the whole row, or the task's reward function on
        its episode's final answer; plus the environment's reward (0 in single-turn jobs)."""
        batch = ro.batch
        if self.reward_model is not None:
            return self.reward_model.score(_inputs(batch)).cpu() + ro.env_rewards
        texts = self.tokenizer.batch_decode(ro.final_ids, skip_special_tokens=True)
        out = [call_reward(self.reward_fn, t, examples[int(g)]["answer"]) for t, g in zip(texts, batch.group_ids)]
        return torch.tensor(out) + ro.env_rewards

    def _normalize(self, scores: torch.Tensor) -> torch.Tensor:
        a = self.cfg.algorithm
        if a.reward_normalization == "none":
            return scores.clamp(-a.reward_clip, a.reward_clip) if a.reward_clip else scores
        # statistics over the whole batch (every rank), so each rank's normalizer state stays identical
        everyone = all_gather_object(scores.tolist())
        start = sum(len(x) for x in everyone[: self.rank])
        full = algos.normalize_rewards(
            torch.tensor([v for x in everyone for v in x]),
            mode=a.reward_normalization,
            clip=a.reward_clip,
            stats=self.reward_stats,
        )
        return full[start : start + len(scores)]

    def _buffered(self, t):
        """The rollout buffer keeps logprobs/values in `buffer_dtype`; the math upcasts to fp32."""
        return None if t is None else t.to(self.buffer_dtype).float()

    def _kl(self, logprobs, ref_logprobs, mask) -> torch.Tensor:
        if ref_logprobs is None:
            return torch.zeros_like(mask)
        return algos.kl_penalty(logprobs, ref_logprobs, self.cfg.algorithm.kl_estimator) * mask

    def _mini_rows(self, n: int) -> int:
        """This rank's rows per mini-batch (all `n` when trainer.mini_batch_size is unset)."""
        return self.setup.mini_rows or n

    def _mini_batches(self, n: int) -> int:
        """Mini-batches per epoch, the same on every rank (forked multi-turn episodes give ranks
        different row counts): the most any rank needs for `n` rows of `_mini_rows` each."""
        return max(1, int(all_reduce_max(float(-(-n // max(self._mini_rows(n), 1))))))  # collective: no early exit

    def _update(self, train: TrainBatch, timer: Timer, n_minis: int) -> tuple[dict, torch.Tensor | None]:
        """`ppo_epochs` over `n_minis` mini-batches -> (metrics, the first epoch's fp32 logprobs when
        `train.on_policy`, else None). On-policy, the first epoch (one mini-batch, in order) computes
        the old logprobs; the later epochs read them, buffered, from a copy of `train`."""
        n = len(train)
        mini = self._mini_rows(n)
        sums: dict[str, float] = {}
        count, first_lp = 0, None
        for _ in range(self.cfg.algorithm.ppo_epochs):
            collect = train.on_policy  # one mini-batch: the whole batch, in order
            perm = torch.arange(n) if collect else torch.randperm(n)
            # mini-batches of `mini` rows; a rank with fewer rows than another splits them as evenly
            parts = perm.split(mini) if -(-n // mini) == n_minis else perm.tensor_split(n_minis)
            for rows in parts:
                mb = train.select(rows)
                tokens, seqs = _global_counts(mb.loss_mask)
                with timer("update_actor", stage="update", role="actor"):
                    acc = self.actor.accumulate(mb, tokens, seqs, keep=collect)
                m = acc.metrics
                if collect:
                    first_lp = acc.outputs.float().cpu()
                if self.critic:
                    with timer("update_critic", stage="update", role="critic"):
                        critic_m = self.critic.accumulate(mb, tokens, seqs).metrics
                    m.update({f"critic/{k}": v for k, v in critic_m.items()})
                    align_overflow(self.actor, self.critic)  # an overflow in either skips both
                    with timer("update_critic", stage="update", role="critic"):
                        self.critic.step()
                with timer("update_actor", stage="update", role="actor"):
                    self.actor.step()
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
            if collect:
                train = train.replace(old_logprobs=self._buffered(first_lp), on_policy=False)
        out = {(k if k.startswith("critic/") else f"actor/{k}"): v / count for k, v in sums.items()}
        if self.critic:
            out["critic/vf_explained_var"] = _explained_var(train.returns, train.old_values, train.loss_mask)
        return out, first_lp

    def _step_metrics(
        self, got: Collected, stored: TrainBatch, scores, old_lp, update_metrics: dict, sync_metrics: dict, timer
    ) -> dict[str, float]:
        """The step's metrics, reduced over ranks; the adaptive KL controller takes this step's KL."""
        batch, mask = got.batch, stored.loss_mask
        kl = self._kl(stored.old_logprobs, stored.ref_logprobs, mask)
        kl_sum, n_tok, n_seq = all_reduce_sum([float((kl * mask).sum()), float(mask.sum()), float(len(batch))])
        kl_mean = kl_sum / max(n_tok, 1.0)
        self.kl_ctl.update(kl_mean, n_steps=int(n_seq))  # same value on every rank
        metrics = reduce_metrics(
            {
                **update_metrics,
                **sync_metrics,
                **timer.times,
                **timer.memory_metrics(),
                **self._batch_metrics(batch, got.raw, scores, old_lp, kl_mean, timer.times["timing_s/step"]),
                **got.metrics,
                **self._distill_metrics(stored),
                "response/truncated_fraction": float(_truncated(batch).mean()),
                **self._precision_metrics(),
            }
        )
        return {**metrics, **self._padding_metrics()}

    def _batch_metrics(self, batch, raw_scores, scores, old_lp, kl_mean, step_s) -> dict[str, float]:
        mask, a = batch.loss_mask, self.cfg.algorithm
        rollout_perf = {k: v for k, v in self.rollout.last_metrics.items() if k.startswith("perf/")}
        return {
            "reward/mean": raw_scores.mean().item(),
            "reward/normalized_mean": scores.mean().item(),
            "response_length/mean": mask.sum(-1).mean().item(),
            # the tail a synchronous step waits for: on a decode-bound GPU its generation follows the max
            "response_length/p90": mask.sum(-1).quantile(0.9).item() if len(mask) else 0.0,
            "response_length/max": mask.sum(-1).max().item() if len(mask) else 0.0,
            "actor/kl_ref": kl_mean,
            "actor/kl_coef": float(self.kl_ctl.value),
            "data/position": float(self.sampler.epoch * self.sampler.n + self.sampler.pos),
            # rollout-vs-trainer gap on the same weights: precision and sync health
            **{
                f"rollout_corr/{k}": float(v)
                for k, v in algos.mismatch_metrics(
                    old_lp, batch.rollout_logprobs, mask, a.clip_low, a.clip_high, a.tis_cap
                ).items()
            },
            "perf/throughput": float(batch.attention_mask.sum()) / max(step_s, 1e-9),
            **rollout_perf,
        }

    def _distill_metrics(self, stored: TrainBatch) -> dict[str, float]:
        """distill/*: the student's per-token reverse KL to the teacher on its own samples (old
        policy, model tokens, mean over every rank's tokens) and the teacher's mean logprob."""
        if self.teacher is None:
            return {}
        mask, teacher = stored.loss_mask, stored.teacher_logprobs
        kl = algos.reverse_kl(stored.old_logprobs, teacher, mask)
        kl_sum, t_sum, n = all_reduce_sum([float(kl.sum()), float((teacher * mask).sum()), float(mask.sum())])
        return {"distill/reverse_kl/mean": kl_sum / max(n, 1.0), "distill/teacher_logprob/mean": t_sum / max(n, 1.0)}

    def _precision_metrics(self) -> dict[str, float]:
        out = {}
        for name, role in self.roles.items():
            for k, v in role.precision_stats().items():
                if isinstance(v, float):
                    out[f"precision/{name}/{k}"] = v
        out["actor/grad_norm"] = out.get("precision/actor/grad_norm", float("nan"))
        return out

    def _padding_metrics(self) -> dict[str, float]:
        """perf/padding_efficiency/<role>/<pass>: real tokens / tokens its forwards ran (every
        rank's), for each role's scoring and update passes of this step. 1.0: no padding ran."""
        keys, sums = [], []
        for name, role in self.roles.items():
            for kind, (real, processed) in role.take_token_counts().items():
                keys.append(f"perf/padding_efficiency/{name}/{kind}")
                sums += [real, processed]
        sums = all_reduce_sum(sums)  # the same roles on every rank: the same list
        return {k: sums[2 * i] / sums[2 * i + 1] for i, k in enumerate(keys) if sums[2 * i + 1]}

    def _decode(self, batch) -> list[str]:
        """Each row's response as text; multi-turn rows with their turns marked ([model] / [env])."""
        lens = batch.response_mask.sum(1).long().tolist()  # right-padded: the first n are the response
        rows = [ids[:n] for ids, n in zip(batch.response_ids.tolist(), lens)]
        if not batch.multi_turn:
            return self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        out = []
        for ids, m in zip(rows, batch.loss_mask.tolist()):
            runs, start = [], 0
            for t in range(1, len(ids) + 1):
                if t == len(ids) or m[t] != m[start]:
                    tag = "[model] " if m[start] else "[env] "
                    runs.append(tag + self.tokenizer.decode(ids[start:t], skip_special_tokens=False))
                    start = t
            out.append("\n".join(runs))
        return out

    def _log_samples(self, batch, examples, scores):
        rows = [
            (examples[int(g)]["prompt"], resp, float(s))
            for g, resp, s in list(zip(batch.group_ids, self._decode(batch), scores))[:16]
        ]
        self.logger.log_samples(rows, self.global_step)

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
        state = {
            "sampler": self.sampler.state_dict(),
            "kl_ctl": self.kl_ctl.state_dict(),
            "reward_stats": self.reward_stats.state_dict(),
        }
        own = None
        if self.partial is not None:  # each rank's pool and draws are its own
            own = {"partial": self.partial.state_dict(), "sampler": self.sampler.state_dict()}
        path = save_checkpoint(
            self.run_dir / "checkpoints",
            self.global_step,
            self._trained_roles(),
            state,
            self.cfg.checkpoint.keep_last,
            rank_state=own,
        )
        self._sleep_roles()
        self.progress.checkpoint(str(path))
        return path

    def _resume(self, path: Path) -> None:
        """Continue from checkpoint `path` (`setup.resume_from`: checked whole before any engine was
        built): the trained roles, this rank's RNG, the sampler, the KL and reward statistics, the
        partial rollouts in flight and the step."""
        trained = self._trained_roles()
        state = load_checkpoint(path, trained)
        self.global_step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.reward_stats.load_state_dict(state["reward_stats"])
        if self.partial is not None:
            if state["rank"] is None or "partial" not in state["rank"]:
                log.warning("resume: %s holds no partial rollouts (written without them): the pool starts empty", path)
            else:
                self.partial.load_state_dict(state["rank"]["partial"])
                self.sampler.load_state_dict(state["rank"]["sampler"])
        sync_distributed(self.rollout, iter_full_params(self.actor.engine))  # the engine started from step 0
        self.progress.checkpoint(str(path))
        if self.rank == 0:
            log.info("resumed from %s at step %d", path, self.global_step)

    def export(self, out_dir: Path, dtype: str) -> None:
        """The actor as an HF model (safetensors) in `dtype`, written atomically."""
        self._wake_roles()
        try:
            if self.cfg.model.lora.rank and self.cfg.checkpoint.export == "adapter":
                export_adapter(self.actor.engine, out_dir, self.tokenizer)
            else:
                export_hf(self.actor.engine, out_dir, dtype, self.tokenizer)
        except OSError as e:
            raise RunFailure(f"exporting {out_dir} failed ({e}); {last_good(self.run_dir / 'checkpoints')}") from None

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        from tqdm import tqdm

        cfg = self.cfg
        metrics: dict[str, float] = {}
        bar = tqdm(total=cfg.trainer.steps, initial=self.global_step, disable=self.rank != 0, desc="train")
        before = cfg.trainer.val_before_train
        try:  # the bar ends its line whatever ends the loop: an error's one line starts a line of its own
            if self.val_prompts and self.global_step == 0 and (before is None or before):
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


def _inputs(batch: RolloutBatch) -> TrainBatch:
    """What a scoring pass reads of a rollout: its rows, and the model's tokens as the loss mask."""
    return TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask)


def _truncated(batch: RolloutBatch) -> torch.Tensor:
    """`[B]` 1.0 where the sample was cut at max_new_tokens."""
    return torch.tensor([f == "length" for f in batch.finish_reasons], dtype=batch.loss_mask.dtype)


def _token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl_penalty: torch.Tensor | None) -> torch.Tensor:
    """`[B, R]` rewards: each sequence's score on its last response token, minus the per-token KL
    penalty when the KL is in the reward."""
    rewards = torch.zeros_like(mask)
    last = mask.cumsum(-1).argmax(-1)  # index of the last response token
    rewards[torch.arange(len(scores)), last] = scores.to(rewards.dtype)
    return rewards - kl_penalty if kl_penalty is not None else rewards


def _per_episode(row_scores: torch.Tensor, episode: torch.Tensor) -> torch.Tensor:
    """One score per episode from its rows' (the rows of a forked episode score alike)."""
    n = int(episode.max()) + 1 if len(episode) else 0
    return torch.zeros(n, dtype=row_scores.dtype).scatter_(0, episode, row_scores)


def _global_counts(mask: torch.Tensor) -> tuple[float, float]:
    """Response tokens and sequences in the whole mini-batch, over every rank (at least 1: a
    mini-batch of only masked-out samples contributes a zero loss, not NaN)."""
    tokens, seqs = all_reduce_sum([float(mask.sum()), float(mask.shape[0])])
    return max(tokens, 1.0), seqs


def _explained_var(returns, values, mask) -> float:
    var_r = algos.masked_var(returns, mask)
    return float(1 - algos.masked_var(returns - values, mask) / (var_r + 1e-8))
