"""Each row's score, and how the loop shapes it: the reward model's score of the whole row, or the
task's reward function on its episode's final answer, plus the environment's reward; DAPO's overlong
penalty; the normalisation `algorithm.reward_normalization` asks for (statistics over every rank's
scores, so each rank's normaliser state stays identical)."""

from __future__ import annotations

import torch

from verl_ds import algos
from verl_ds.config import RunConfig
from verl_ds.data.reward import call_reward, normalize_reward
from verl_ds.dist import all_gather_object
from verl_ds.rollout import RolloutBatch
from verl_ds.rollout.episodes import Rollout
from verl_ds.trainer.groups import scoring_inputs


class Rewards:
    """`reward_model` (a `RewardModel` role) or `reward_fn` (`(text, answer) -> float`) scores; the
    running statistics of `reward_normalization: running` live here (checkpointed with the run)."""

    def __init__(self, cfg: RunConfig, reward_fn, reward_model, tokenizer, rank: int):
        self.algorithm, self.rollout_cfg = cfg.algorithm, cfg.rollout
        self.reward_fn, self.reward_model, self.tokenizer, self.rank = reward_fn, reward_model, tokenizer, rank
        self.stats = algos.RunningMeanStd()

    def score(self, ro: Rollout, examples: list[dict]) -> torch.Tensor:
        """Each row's score: the reward model's on the whole row, or the task's reward function on
        its episode's final answer; plus the environment's reward (0 in single-turn jobs)."""
        batch = ro.batch
        if self.reward_model is not None:
            return self.reward_model.score(scoring_inputs(batch)).cpu() + ro.env_rewards
        texts = self.tokenizer.batch_decode(ro.final_ids, skip_special_tokens=True)
        out = [call_reward(self.reward_fn, t, examples[int(g)]["answer"]) for t, g in zip(texts, batch.group_ids)]
        return torch.tensor(out) + ro.env_rewards

    def overlong(self, batch: RolloutBatch) -> torch.Tensor:
        """DAPO's soft penalty of responses near `max_new_tokens` (zeros when `overlong.buffer_len` is 0)."""
        o, r = self.algorithm.overlong, self.rollout_cfg
        lengths = batch.loss_mask.sum(-1)
        return (
            algos.overlong_penalty(lengths, r.max_new_tokens, o.buffer_len, o.penalty)
            if o.buffer_len
            else torch.zeros_like(lengths)
        )

    def normalize(self, scores: torch.Tensor) -> torch.Tensor:
        """This rank's scores normalised over the whole batch (`data.reward.normalize_reward`). Collective
        unless the mode is "none"."""
        a = self.algorithm
        if a.reward_normalization == "none":
            return normalize_reward(scores, "none", a.reward_clip)
        everyone = all_gather_object(scores.tolist())
        start = sum(len(x) for x in everyone[: self.rank])
        full = torch.tensor([v for x in everyone for v in x])
        return normalize_reward(full, a.reward_normalization, a.reward_clip, self.stats)[start : start + len(scores)]
