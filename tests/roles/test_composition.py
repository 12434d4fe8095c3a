"""The trainer consistent with itself: the same rows' logprobs under every batch composition a pass can
take (row micro-batches of any size, token budgets, packed rows, shared prefixes) against each row run
alone (`Role.rows_alone`, what `trainer_corr/` compares with). Bounded from the format: fp32 to its
rounding; a 16-bit format to `algos.probe_bound` (its kernels decide where it is bitwise: on an
avx512_bf16 host the padded compositions are, the packed and shared ones move by ~1e-3)."""

import pytest

from tests.roles.helpers import ds_config
from tests.roles.test_prefix import tree_batch
from verl_ds import algos
from verl_ds.roles import Reference, load_causal_lm

COMPOSITIONS = {
    "micro_8": dict(micro_batch_size=8),
    "micro_3": dict(micro_batch_size=3),
    "budget_30": dict(max_tokens=30),
    "packed": dict(packing=True),
    "shared": dict(share_prefixes=True, share_min_tokens=0),
}


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def reference(request, tiny_model_dir):
    return Reference(load_causal_lm(tiny_model_dir), ds_config("reference", 0, request.param, micro=8, total=8))


@pytest.mark.numerics
@pytest.mark.parametrize("composition", sorted(COMPOSITIONS))
def test_every_composition_scores_the_rows_as_each_row_alone(reference, composition):
    batch = tree_batch(reference.module.config.vocab_size)
    real = batch.loss_mask.bool()
    with reference.rows_alone():
        alone = reference.logprobs(batch)
    saved = {k: getattr(reference, k) for k in COMPOSITIONS[composition]}
    for k, v in COMPOSITIONS[composition].items():
        setattr(reference, k, v)
    try:
        got = reference.logprobs(batch)
    finally:
        for k, v in saved.items():
            setattr(reference, k, v)
    bound = 1e-5 if reference.dtype == "fp32" else algos.probe_bound(reference.dtype, reference.dtype)
    gap = float((got[real] - alone[real]).abs().max())
    assert gap <= bound, (composition, reference.dtype, gap)


def test_rows_alone_runs_each_row_by_itself_and_restores_the_role(reference):
    """One row a forward, unshared, unpacked and without the budget, the step's token counts untouched;
    the role's own composition back afterwards."""
    batch = tree_batch(reference.module.config.vocab_size)
    reference.max_tokens, reference.share_prefixes, reference.packing = 30, True, True
    shapes = []
    hook = reference.module.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        reference.take_token_counts()
        with reference.rows_alone():
            assert [len(i) for i in reference.micro_indices(batch)] == [1] * len(batch)
            reference.logprobs(batch)
        assert len(shapes) == len(batch) and all(s[0] == 1 for s in shapes)
        assert reference.take_token_counts()["score"] == (0.0, 0.0, 0.0)
        assert (reference.max_tokens, reference.share_prefixes, reference.packing) == (30, True, True)
    finally:
        hook.remove()
        reference.max_tokens, reference.share_prefixes, reference.packing = 0, False, False
