"""Dynamic sampling's group bookkeeping (pure logic on real RolloutBatches)."""

import torch

from verl_ds.rollout import RolloutBatch
from verl_ds.trainer.groups import Collected, varied_groups


def _batch(groups: int, n: int) -> RolloutBatch:
    rows = [g for g in range(groups) for _ in range(n)]
    return RolloutBatch.from_lists(
        [[1, g + 3] for g in rows],
        [[5 + i % n] for i in range(len(rows))],
        [[-0.5]] * len(rows),
        ["stop"] * len(rows),
        rows,
        pad_id=0,
    )


def test_varied_select_and_merge():
    b = _batch(3, 2)
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # only group 1 varies
    assert varied_groups(scores, b.group_ids, 3) == [1]
    kept = Collected(b, ["a", "b", "c"], scores, scores * 2).select_groups([1])
    assert kept.batch.group_ids.tolist() == [0, 0] and kept.examples == ["b"] and kept.raw.tolist() == [0.0, 1.0]
    assert kept.shaped.tolist() == [0.0, 2.0] and kept.batch.to_lists()["prompts"] == [[1, 4], [1, 4]]
    b2 = _batch(2, 2)
    merged = Collected.merge([kept, Collected(b2, ["d", "e"], torch.ones(4), torch.ones(4))])
    assert merged.batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2] and merged.examples == ["b", "d", "e"]
    assert len(merged.raw) == len(merged.shaped) == len(merged.batch) == 6
    assert b2.group_ids.tolist() == [0, 0, 1, 1]  # merging offsets a copy, not the part's batch
    first_two = merged.select_groups([0, 1])
    assert first_two.examples == ["b", "d"] and first_two.batch.group_ids.tolist() == [0, 0, 1, 1]
