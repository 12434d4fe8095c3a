"""Dynamic sampling's group bookkeeping (pure logic on real RolloutBatches)."""

import torch

from verl_ds.rollout import RolloutBatch
from verl_ds.trainer.groups import merge_parts, select_groups, varied_groups


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
    kept = select_groups(b, ["a", "b", "c"], scores, scores * 2, [1])
    assert kept[0].group_ids.tolist() == [0, 0] and kept[1] == ["b"] and kept[2].tolist() == [0.0, 1.0]
    assert kept[0].to_lists()["prompts"] == [[1, 4], [1, 4]]
    b2 = _batch(2, 2)
    merged = merge_parts([kept, (b2, ["d", "e"], torch.ones(4), torch.ones(4))])
    assert merged[0].group_ids.tolist() == [0, 0, 1, 1, 2, 2] and merged[1] == ["b", "d", "e"]
    assert len(merged[2]) == len(merged[0]) == 6
    first_two = select_groups(*merged, [0, 1])
    assert first_two[1] == ["b", "d"] and first_two[0].group_ids.tolist() == [0, 0, 1, 1]
