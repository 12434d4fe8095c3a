"""Rollout ranks apart, under the launcher with two ranks: rank 0 trains, rank 1 only generates
(`trainer.rollout_ranks: 1`). Run by test_rollout_ranks.py. The trainer rank prints one `RESULT {json}`
line: each step's policy lag, probe gap and bytes, and whether step 0's rows and the validation before
it are, bit for bit, what a colocated engine samples (and scores) for the same prompts and seeds.
`stale`: the syncs after step 0 hold q_proj back (a weight that did not land); the probe must stop the
run at the next step, before its optimizer step. `run` ends as `fit` does (the final checkpoint, the
export); `fit`: the run's own loop, with the config overrides that follow."""

import json
import os
import sys

import verl_ds.trainer.rl_trainer as rl_trainer
from tests.trainer.test_sync_probe import JOB, VLLM_JOB
from verl_ds.config import load_config
from verl_ds.data.dataset import PromptSampler
from verl_ds.diagnostics.observers import TrainerObserver
from verl_ds.dist import bridge, init_distributed, is_rollout_rank
from verl_ds.errors import RunFailure
from verl_ds.rollout import episodes, make_rollout
from verl_ds.rollout.episodes import Sampling, SeedKey
from verl_ds.trainer import validation
from verl_ds.trainer.rollout_rank import serve

SPLIT = ["trainer.rollout_ranks=1", "algorithm.tis_cap=2.0", "trainer.steps=4", "checkpoint.every=0"]
# validation before the first step and after every second one: 8 held-out prompts, 2 samples each
VAL = ["data.arithmetic.size=64", "data.val_fraction=0.125", "trainer.val_n=2", "trainer.val_every=2"]
VAL += ["trainer.val_before_train=true"]


class Rows(TrainerObserver):
    def __init__(self):
        self.batches = []

    def on_rollout(self, trainer, rollout, scores):
        self.batches.append(rollout)


def main(run_dir: str, mode: str, *overrides: str) -> None:
    job = VLLM_JOB if "rollout.engine=vllm" in overrides else JOB
    val = VAL if mode != "stale" else []
    cfg = load_config(None, [*job, *SPLIT, *val, f"trainer.run_dir={run_dir}", *overrides])
    init_distributed(cfg.trainer.collective_timeout_s, cfg.trainer.rollout_ranks)
    if is_rollout_rank():
        serve(cfg, bridge())
        return
    if mode == "fit":
        with rl_trainer.RLTrainer(cfg) as trainer:
            trainer.fit()
            split = trainer.actor.sp is not None  # the actor's rows run split over a sequence-parallel group
        print("RESULT " + json.dumps({"sequence_parallel": split}), flush=True)
        return
    out = {"line": None, "steps": []}
    with rl_trainer.RLTrainer(cfg) as trainer:
        rows = Rows()
        trainer.observers.append(rows)
        if mode != "stale":  # validation before step 1, as `fit` runs and logs it, against a colocated engine's
            s, r = trainer.setup, cfg.rollout
            local = make_rollout(r, trainer.model_path, s.precision.rollout, cfg.trainer.seed)
            val = trainer.validate()
            trainer.logger.log(val, 0)

            def here(examples, sampling, seed):
                ids = [e["prompt_ids"] for e in examples]
                return episodes.collect(local, examples, ids, sampling, seed, trainer.episode_spec)

            want, _ = validation.validate(cfg, trainer.val_prompts, 0, here, trainer.rewards.score, local, None, False)
            out["val_equal"] = bool(val == want and val)
        out["steps"].append(trainer.step())
        if mode == "stale":
            real = rl_trainer.iter_full_params
            initial = {n: t.clone() for n, t in real(trainer.actor.engine) if "q_proj" in n}
            rl_trainer.iter_full_params = lambda e: ((n, initial.get(n, t)) for n, t in real(e))
        else:  # step 0's episodes against a colocated engine's on the same (initial) weights, prompts and seeds
            sampler = PromptSampler(len(trainer.prompts), cfg.data.seed, cfg.data.shuffle)
            examples = [trainer.prompts[i] for i in sampler.draw(cfg.trainer.prompts_per_step, 0, 1)]
            ids = [e["prompt_ids"] for e in examples]
            sampling = Sampling(r.n, r.temperature, r.top_p, r.max_new_tokens, r.top_k)
            want = episodes.collect(local, examples, ids, sampling, SeedKey(cfg.trainer.seed, 0), trainer.episode_spec)
            got = rows.batches[0]
            out["rows_equal"] = bool(
                (got.batch.input_ids == want.batch.input_ids).all()
                and (got.batch.rollout_logprobs == want.batch.rollout_logprobs).all()
                and (got.batch.loss_mask == want.batch.loss_mask).all()
                and (got.env_rewards == want.env_rewards).all()
                and got.final_ids == want.final_ids
            )
        try:
            for _ in range(cfg.trainer.steps - 1):
                before = trainer.actor.engine.global_steps
                out["steps"].append(trainer.step())
        except RunFailure as e:
            out["line"] = str(e)
            out["optimizer_stepped"] = trainer.actor.engine.global_steps != before
        keep = (
            "rollout/policy_lag",
            "rollout/sync_probe_gap",
            "sync/bytes_full",
            "sync/bytes_sent",
            "timing_s/rows_wait",
            "multi_turn/turns/mean",
        )
        out["steps"] = [{k: m[k] for k in keep if k in m} for m in out["steps"]]
        if out["line"] is None:  # as `fit` ends: the final checkpoint and the exported model
            trainer.save()
            trainer.export(trainer.run_dir / "final_model", cfg.checkpoint.export_dtype)
        print("RESULT " + json.dumps(out), flush=True)
        if out["line"]:  # the rollout rank waits for weights that will not come: end here
            os._exit(0)


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])  # DeepSpeed's launcher adds it
