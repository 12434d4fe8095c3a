"""Build real role engines from rendered configs for tests."""

import torch

from verl_ds.config import AlgorithmConfig, read_ds_json
from verl_ds.ds_config import render_role
from verl_ds.precision import Hardware, LossScaling, PrecisionConfig, resolve_precision
from verl_ds.roles.batch import TrainBatch

FP32_CPU = Hardware("cpu")  # `auto` -> fp32: the tests pin every dtype they assert on anyway


def Cfg(**kw) -> AlgorithmConfig:
    """The real loss config (AlgorithmConfig) with the role tests' defaults."""
    return AlgorithmConfig(**{"use_kl_loss": False, "kl_coef": 0.0, **kw})


def ds_config(role: str, stage: int, dtype: str, micro: int = 2, total: int = 4, hysteresis: int = 2) -> dict:
    files = {
        "actor": "actor_zero3_fp32.json",
        "critic": "critic_zero2_fp32.json",
        "reference": "ref_zero3.json",
        "reward": "reward_zero0.json",
    }
    base = read_ds_json(files[role], "test")
    base.setdefault("zero_optimization", {})["stage"] = stage
    prec = PrecisionConfig(
        **{f"{role}_dtype": dtype},
        **({f"{role}_loss_scaling": LossScaling(hysteresis=hysteresis)} if role in ("actor", "critic") else {}),
    )
    return render_role(
        role,
        base,
        files[role],
        resolve_precision(prec, FP32_CPU),
        micro_batch_size=micro,
        train_batch_size=total,
        world_size=1,
        max_grad_norm=1.0,
        optimizer_params={"lr": 1e-2, "weight_decay": 0.0, "betas": [0.9, 0.999]},
    )


def make_batch(vocab: int, b: int = 4, p: int = 5, r: int = 3, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, p + r), generator=g)
    attn = torch.ones(b, p + r, dtype=torch.long)
    attn[0, :2] = 0  # left padding in the prompt
    ids[0, :2] = 0
    resp = torch.ones(b, r)
    resp[1, -1] = 0  # right padding in the response
    attn[1, -1] = 0
    return TrainBatch(ids, attn, resp)


def make_group_batch(vocab: int, prompt_lens=(2, 5, 4), resp_lens=(1, 3, 2, 3), seed: int = 0) -> TrainBatch:
    """GRPO-shaped rows: each prompt (left-padded) with len(resp_lens) responses (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    P, R, n = max(prompt_lens), max(resp_lens), len(resp_lens)
    b = len(prompt_lens) * n
    ids, attn = torch.zeros(b, P + R, dtype=torch.long), torch.zeros(b, P + R, dtype=torch.long)
    resp = torch.zeros(b, R)
    for k, p in enumerate(prompt_lens):
        prompt = torch.randint(3, vocab, (p,), generator=g)
        for j, r in enumerate(resp_lens):
            i = k * n + j
            ids[i, P - p : P], ids[i, P : P + r] = prompt, torch.randint(3, vocab, (r,), generator=g)
            attn[i, P - p : P + r], resp[i, :r] = 1, 1
    return TrainBatch(ids, attn, resp)


def accumulated_grads(actor, batch: TrainBatch) -> dict:
    """One mini-batch's gradient, reduced and assembled per parameter (any ZeRO stage), taken after
    `accumulate` and before the optimizer step; `step()` then applies it."""
    from deepspeed.utils import safe_get_full_grad

    actor.accumulate(batch, global_tokens=float(batch.loss_mask.sum()), global_seqs=float(len(batch)))
    grads = {n: safe_get_full_grad(p).detach().float().clone() for n, p in actor.module.named_parameters()}
    actor.step()
    return grads


# fp32 gradients of one mini-batch computed in another order (micro-batch split, padding, a shared
# prompt pass) differ by rounding: a few ulps of the largest terms summed into each element. 1e-4 of
# the tensor's largest element is far above that on every CPU kind's kernels and far below what a
# real mistake gives (a row dropped or counted twice moves elements by ~1/B of the scale).
GRAD_RTOL_OF_SCALE = 1e-4


def assert_same_gradients(got: dict, want: dict) -> None:
    """Per tensor: max |got - want| <= GRAD_RTOL_OF_SCALE x max |want| (summation order only)."""
    assert set(got) == set(want)
    for n, w in want.items():
        scale = float(w.abs().max())
        err = float((got[n] - w).abs().max())
        assert scale > 0, f"{n}: no gradient reached it (the test would prove nothing)"
        assert err <= GRAD_RTOL_OF_SCALE * scale, f"{n}: max |diff| {err:.3g} vs scale {scale:.3g}"


def update(role, batch: TrainBatch, global_tokens: float, global_seqs: float) -> dict:
    """One mini-batch's accumulate and optimizer step, as the trainer runs them: the metrics."""
    metrics = role.accumulate(batch, global_tokens, global_seqs).metrics
    role.step()
    return metrics
