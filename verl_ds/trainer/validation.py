"""Validation on held-out prompts with the rollout engine's current weights: greedy accuracy (mean
reward at temperature 0) and, from `trainer.val_n` samples at the rollout temperature, mean@k and
unbiased pass@k (a sample passes with reward >= 1); multi-turn jobs add the greedy episodes' turns
and tool use. Collective: every rank runs it on its share of the prompts."""

from __future__ import annotations

from typing import Callable

import torch

from verl_ds import algos
from verl_ds.config import RunConfig
from verl_ds.dist import all_reduce_sum
from verl_ds.rollout.episodes import Rollout, Sampling, SeedKey
from verl_ds.trainer.samples import MAX_ROWS, decode_responses

Episodes = Callable[[list[dict], Sampling, SeedKey], Rollout]  # the trainer's rollout of examples
Score = Callable[[Rollout, list[dict]], torch.Tensor]  # each row's score


def per_episode(row_scores: torch.Tensor, episode: torch.Tensor) -> torch.Tensor:
    """One score per episode from its rows' (the rows of a forked episode score alike)."""
    n = int(episode.max()) + 1 if len(episode) else 0
    return torch.zeros(n, dtype=row_scores.dtype).scatter_(0, episode, row_scores)


def requests(cfg: RunConfig, step: int) -> tuple[tuple[Sampling, SeedKey], tuple[Sampling, SeedKey]]:
    """What validation at `step` generates, in order: one greedy sample per prompt, then `trainer.val_n`
    at the rollout's temperature (a rollout rank apart generates exactly these, `trainer/rollout_rank.py`)."""
    r, t = cfg.rollout, cfg.trainer
    tag = f"val{step}"  # seeds apart from every training step's
    return (
        (Sampling(1, 0.0, 1.0, r.max_new_tokens), SeedKey(t.seed, tag)),
        (Sampling(t.val_n, r.temperature, r.top_p, r.max_new_tokens, r.top_k), SeedKey(t.seed, tag, 1)),
    )


def due(cfg: RunConfig, step: int, has_prompts: bool) -> bool:
    """Validation runs after `step` (0: before the first step): `trainer.val_before_train` (null: yes) and
    every `trainer.val_every` steps, where there are held-out prompts."""
    t = cfg.trainer
    if not has_prompts:
        return False
    if step == 0:
        return t.val_before_train is None or t.val_before_train
    return bool(t.val_every) and step % t.val_every == 0


def validate(
    cfg: RunConfig,
    mine: list[dict],
    step: int,
    episodes: Episodes,
    score: Score,
    rollout,
    tokenizer,
    samples: bool,
) -> tuple[dict[str, float], list[tuple[str, str, float]]]:
    """This rank's held-out prompts `mine` at `step` -> (the metrics over every rank, and with `samples`
    (the rank that logs them) this rank's sample rows: prompt, greedy response, its score)."""
    k, name = cfg.trainer.val_n, cfg.data.task
    (greedy_sampling, greedy_seed), (k_sampling, k_seed) = requests(cfg, step)
    greedy = episodes(mine, greedy_sampling, greedy_seed)
    sampled = episodes(mine, k_sampling, k_seed)
    # the next generation comes without a sync (the weights stay, on the host) and a checkpoint or
    # the export may wake the roles first
    rollout.sleep(level=1)
    acc = per_episode(score(greedy, mine), greedy.episode)
    scores = per_episode(score(sampled, mine), sampled.episode).view(len(mine), k) if mine else torch.zeros(0, k)
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
    rows = []
    if samples and mine:
        last_rows = [int((greedy.episode == e).nonzero()[-1]) for e in range(len(mine))]  # forks: the last
        texts = decode_responses(tokenizer, greedy.batch.select(last_rows))
        rows = [(e["prompt"], text, float(s)) for e, text, s in zip(mine, texts, acc)][:MAX_ROWS]
    out = {
        f"val/{name}/accuracy": tot[0] / n,
        f"val/{name}/mean@{k}": tot[1] / n,
        f"val/{name}/pass@{k}": tot[2] / n,
        "val/response_length/mean": tot[3] / n,
    }
    # multi-turn: the greedy episodes' turns and tool use (mean over ranks, as every metric)
    keep = ("tools/", "multi_turn/turns", "agent/calls", "agent/failures")
    out.update({f"val/{key}": v for key, v in greedy.metrics.items() if key.startswith(keep)})
    return out, rows
