"""RolloutBatch padding, masks, select/chunk/cat: pure logic, no model."""

import torch

from verl_ds.rollout import RolloutBatch


def _batch():
    return RolloutBatch.from_lists(
        prompts=[[1, 5], [1, 6, 7, 8], [1]],
        responses=[[9, 2], [10], [11, 12, 13]],
        logprobs=[[-0.5, -0.1], [-1.0], [-0.2, -0.3, -0.4]],
        finish_reasons=["stop", "length", "length"],
        group_ids=[0, 0, 1],
        pad_id=0,
    )


def test_padding_and_masks():
    b = _batch()
    assert b.prompt_ids.tolist() == [[0, 0, 1, 5], [1, 6, 7, 8], [0, 0, 0, 1]]  # left
    assert b.response_ids.tolist() == [[9, 2, 0], [10, 0, 0], [11, 12, 13]]  # right
    assert torch.equal(b.input_ids, torch.cat([b.prompt_ids, b.response_ids], 1))
    assert b.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1]]
    assert b.attention_mask.dtype == torch.long
    assert b.response_mask.dtype == torch.float32 and b.rollout_logprobs.dtype == torch.float32
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]  # eos (2) is in the mask
    assert b.rollout_logprobs[1].tolist() == [-1.0, 0.0, 0.0]
    assert b.group_ids.tolist() == [0, 0, 1] and len(b) == 3


def test_select_chunk_cat_roundtrip():
    b = _batch()
    parts = b.chunk(2)
    assert [len(p) for p in parts] == [2, 1]
    assert parts[1].finish_reasons == ["length"] and parts[1].group_ids.tolist() == [1]
    assert parts[1].prompt_ids.shape == (1, 4)  # select keeps padding
    back = RolloutBatch.cat(parts)
    for f in ("prompt_ids", "response_ids", "input_ids", "attention_mask", "response_mask", "rollout_logprobs"):
        assert torch.equal(getattr(back, f), getattr(b, f)), f
    assert back.finish_reasons == b.finish_reasons
    assert b.select([2, 0]).to_lists()["responses"] == [[11, 12, 13], [9, 2]]


def test_cat_repads_to_widest():
    a = RolloutBatch.from_lists([[1]], [[4]], [[-1.0]], ["length"], [0], pad_id=0)
    c = RolloutBatch.cat([a, _batch()])
    assert c.prompt_ids.shape == (4, 4) and c.response_ids.shape == (4, 3)
    assert c.prompt_ids[0].tolist() == [0, 0, 0, 1] and c.response_ids[0].tolist() == [4, 0, 0]
    assert c.to_lists()["logprobs"][0] == [-1.0]
    assert len(RolloutBatch.chunk(a, 3)[2]) == 0  # empty parts are fine (scatter)
