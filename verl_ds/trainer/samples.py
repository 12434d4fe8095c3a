"""Sample tables: a batch's responses as text, for the run's samples and validation tables in W&B."""

from __future__ import annotations

from verl_ds.rollout import RolloutBatch

MAX_ROWS = 16  # a table a reader scans, not the batch


def decode_responses(tokenizer, batch: RolloutBatch) -> list[str]:
    """Each row's response as text; multi-turn rows with their turns marked ([model] / [env])."""
    lens = batch.response_mask.sum(1).long().tolist()  # right-padded: the first n are the response
    rows = [ids[:n] for ids, n in zip(batch.response_ids.tolist(), lens)]
    if not batch.multi_turn:
        return tokenizer.batch_decode(rows, skip_special_tokens=True)
    out = []
    for ids, m in zip(rows, batch.loss_mask.tolist()):
        runs, start = [], 0
        for t in range(1, len(ids) + 1):
            if t == len(ids) or m[t] != m[start]:
                tag = "[model] " if m[start] else "[env] "
                runs.append(tag + tokenizer.decode(ids[start:t], skip_special_tokens=False))
                start = t
        out.append("\n".join(runs))
    return out


def sample_rows(tokenizer, batch: RolloutBatch, examples: list[dict], scores) -> list[tuple[str, str, float]]:
    """(prompt, response, score) of the batch's first rows."""
    pairs = list(zip(batch.group_ids, decode_responses(tokenizer, batch), scores))[:MAX_ROWS]
    return [(examples[int(g)]["prompt"], resp, float(s)) for g, resp, s in pairs]
