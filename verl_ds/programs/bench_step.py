"""`verl-ds bench step`: where one training step's time goes, and how far it is from a floor.

Measured in one run, in this process's world (1 rank; under the launcher, this rank's share):
- verl-ds: median per-phase seconds over `steps` steps after one warm-up step, tokens/s;
- training MFU: the actor update's model FLOPs (6 x params x tokens x epochs, plus 2 x params x
  tokens for each extra forward; the tokens the actor runs, so a shared prompt counts once) against
  the matmul rate of the actor's dtype measured here;
- a plain-PyTorch floor for the same job: the same HF model, batch, sampling and loss (group
  advantages, PPO clip, k3 KL to a frozen copy, AdamW, gradient checkpointing if the job has it,
  each prompt run once for its n responses where verl-ds does), no DeepSpeed, no vLLM, no
  bookkeeping; under the launcher each rank's floor trains alone (no gradient all-reduce). Its
  steps alternate with verl-ds's.
Printed as ratios.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from verl_ds import algos
from verl_ds.dist import on_gpu
from verl_ds.precision import TORCH_DTYPES
from verl_ds.roles import prefix
from verl_ds.roles.base import model_inputs
from verl_ds.roles.ds_internals import full_numel
from verl_ds.trainer.rl_trainer import RLTrainer

_DEV = "cuda" if on_gpu() else "cpu"


def _now() -> float:
    """A timestamp after the GPU's queued work (CUDA kernels run asynchronously)."""
    if _DEV == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def matmul_rate(dtype: str, n: int | None = None, reps: int = 5) -> float:
    """FLOP/s of an n x n matmul in `dtype` on this machine (CPU or the current GPU; a GPU needs
    large matrices to reach its rate)."""
    n = n or (8192 if _DEV == "cuda" else 1024)
    a = torch.randn(n, n, device=_DEV).to(TORCH_DTYPES[dtype])
    a @ a
    t0 = _now()
    for _ in range(reps):
        a @ a
    return reps * 2 * n**3 / (_now() - t0)


def floor_steps(model_path: str, prompts: list[list[int]], cfg, dtype: str, pad_id: int, eos_ids: list[int]):
    """(Long on purpose: the plain-PyTorch yardstick, kept whole to be checked against verl-ds's step.)
    A minimal GRPO step in plain PyTorch on the same job, as a generator: each `next()` runs one
    step and yields its phases' seconds under verl-ds's names (the first includes warm-up), so it can
    alternate with verl-ds's steps."""
    from transformers import AutoModelForCausalLM

    a, r = cfg.algorithm, cfg.rollout
    dt = TORCH_DTYPES[dtype]
    share = cfg.model.share_prompt  # the shared prompt as one sequence under a mask (`roles/prefix.py`)
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=dt).to(_DEV)
    ref = copy.deepcopy(policy).eval().requires_grad_(False) if a.kl_coef > 0 else None
    if cfg.precision.enable_grad_checkpointing:  # part of the job (memory), so the floor pays it too
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.roles.actor.lr, weight_decay=0.0, fused=True)  # as the roles
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts for _ in range(r.n)], device=_DEV)
    attn = (
        torch.arange(width, device=_DEV)[None]
        >= torch.tensor([width - len(p) for p in prompts for _ in range(r.n)], device=_DEV)[:, None]
    ).long()
    groups = torch.arange(len(prompts), device=_DEV).repeat_interleave(r.n)
    while True:
        t = [_now()]
        policy.eval()  # HF checkpoints layers only in train mode
        with torch.no_grad():
            out = policy.generate(
                input_ids=ids,
                attention_mask=attn,
                do_sample=True,
                temperature=r.temperature,
                top_k=0,
                max_new_tokens=r.max_new_tokens,
                pad_token_id=pad_id,
                eos_token_id=eos_ids,
            )
        t.append(_now())
        seq = out[:, width:]
        mask = torch.ones_like(seq, dtype=torch.float32)
        full_attn = torch.cat([attn, torch.ones_like(seq)], 1)
        scores = torch.rand(len(seq), device=_DEV)  # reward cost is not the framework's
        adv = algos.grpo_advantages(scores=scores, response_mask=mask, group_ids=groups)

        inputs = model_inputs(out, full_attn)

        def logprobs(model, inputs=inputs, seq=seq, out=out, full_attn=full_attn):  # prompts shared as verl-ds does
            if share:  # every response column is held (mask of ones): K = B x R logits, in row order
                pack = prefix.pack(out, prefix.held_columns(full_attn, seq.shape[1]))
                keep, _ = pack.response(seq.shape[1])
                mask = prefix.attention_mask(pack, "sdpa", dt)
                logits = model(**pack.inputs(mask), use_cache=False, logits_to_keep=keep).logits.view(*seq.shape, -1)
            else:
                logits = model(**inputs).logits[:, width - 1 : -1]
            logits = logits.float() / r.temperature
            return torch.log_softmax(logits, -1).gather(-1, seq[..., None])[..., 0]

        with torch.no_grad():
            ref_lp = logprobs(ref) if ref is not None else None
        t.append(_now())
        old = None  # the first epoch's forward is the old policy
        policy.train()
        for _ in range(a.ppo_epochs):
            lp = logprobs(policy)
            old = lp.detach() if old is None else old
            loss, _ = algos.policy_loss(old, lp, adv, mask, clip_low=a.clip_low, clip_high=a.clip_high)
            if ref_lp is not None:
                loss = loss + a.kl_coef * algos.masked_mean(algos.kl_penalty(lp, ref_lp, a.kl_estimator), mask)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.trainer.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        t.append(_now())
        yield {"gen": t[1] - t[0], "ref": t[2] - t[1], "update_actor": t[3] - t[2], "step": t[3] - t[0]}


# a timed phase -> the role pass whose `perf/padding_efficiency/<role>/<pass>` it reports
PHASE_PASS = {
    "update_actor": "actor/update",
    "old_logprob": "actor/score",
    "ref": "reference/score",
    "teacher": "teacher/score",
    "values": "critic/score",
    "update_critic": "critic/update",
}


def bench_step(cfg, steps: int = 5) -> dict[str, float]:
    """(A benchmark program read top to bottom: build both, alternate their steps, print the ratios.)
    Run `steps` (+1 warm-up) verl-ds steps and as many plain-PyTorch floor steps, alternating (a
    shared host's speed drifts: back to back, one side could get the slow minutes); print ratios."""
    with RLTrainer(cfg) as trainer:
        dtype = trainer.precision.actor
        prompts = [e["prompt_ids"] for e in trainer.prompts[: cfg.trainer.prompts_per_step // trainer.world]]
        model_path, pad = trainer.model_path, trainer.tokenizer.pad_token_id
        eos = [trainer.tokenizer.eos_token_id]
        params = sum(full_numel(p) for p in trainer.actor.module.parameters())
        plain = floor_steps(model_path, prompts, cfg, dtype, pad, eos)
        trainer.step()  # warm-up, both sides
        next(plain)
        rows, floor_times = [], []
        for _ in range(steps):
            rows.append(trainer.step())
            floor_times.append(next(plain))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.startswith("timing_s/")}
    step_s = med["timing_s/step"]
    tokens = statistics.median(r["perf/throughput"] for r in rows) * step_s / trainer.world  # this rank's
    run = tokens  # the tokens the actor's forwards run (FLOPs): a shared prompt once, not n times
    if trainer.actor.share_prefixes:
        run -= (cfg.rollout.n - 1) * sum(len(p) for p in prompts)
    rate = matmul_rate(dtype)
    passes = (
        cfg.algorithm.ppo_epochs * 3 + (1 if "timing_s/old_logprob" in med else 0) + (1 if "timing_s/ref" in med else 0)
    )  # fwd+bwd = 3 forward-equivalents per epoch
    mfu = (
        2
        * params
        * run
        * passes
        / max(
            med.get("timing_s/update_actor", 0) + med.get("timing_s/old_logprob", 0) + med.get("timing_s/ref", 0), 1e-9
        )
        / rate
    )
    eff = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.startswith("perf/padding_efficiency/")}
    floor_med = {k: statistics.median(f[k] for f in floor_times) for k in floor_times[0]}
    floor = floor_med["step"]
    out = {
        "bench/step_s": step_s,
        "bench/floor_step_s": floor,
        "bench/over_floor": step_s / floor,
        "bench/tokens_per_s": tokens / step_s,
        "bench/train_mfu": mfu,
        "bench/matmul_flops": rate,
        **{f"bench/{k}": v for k, v in med.items()},
        **{f"bench/floor/{k}": v for k, v in floor_med.items()},
        **{f"bench/{k}": v for k, v in eff.items()},
    }
    print(
        f"model {params / 1e6:.2f}M params ({dtype}), {len(prompts)} prompts x n={cfg.rollout.n} per rank, "
        f"{steps} steps after a warm-up, world size {trainer.world}"
    )
    print("| phase | verl-ds s | share of step | padding efficiency | plain-PyTorch floor s |\n|---|---|---|---|---|")
    for k, v in sorted(med.items(), key=lambda kv: -kv[1]):
        name = k[len("timing_s/") :]
        if name != "step" and v > 0:
            fl = f"{floor_med[name]:.3f}" if name in floor_med else "-"
            pe = eff.get(f"perf/padding_efficiency/{PHASE_PASS.get(name)}")
            print(f"| {name} | {v:.3f} | {100 * v / step_s:.1f}% | {'-' if pe is None else f'{pe:.2f}'} | {fl} |")
    print(f"| **step** | {step_s:.3f} | 100% | | {floor:.3f} |")
    print(
        f"\ntokens/s {tokens / step_s:.0f}; training MFU {100 * mfu:.1f}% of the measured {dtype} matmul rate "
        f"({rate / 1e9:.0f} GFLOP/s)"
    )
    print(
        f"plain-PyTorch floor (same model, batch, loss; HF generate; no sync, no bookkeeping): {floor:.3f} s/step "
        f"-> verl-ds / floor = {step_s / floor:.2f}x"
    )
    return out
