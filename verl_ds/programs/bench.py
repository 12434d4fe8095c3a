"""`verl-ds bench rollout`: is vLLM worth it here, and what does a weight sync cost?

Measured in one run on the same model and prompts: generation tokens/s of VLLMRollout vs HFRollout
(the ratio), and VLLMRollout.sync_weights time vs one training step. The training step is a plain
torch AdamW forward/backward/step on the same model and batch shape (not a DeepSpeed Actor: that
needs the process group and ~20 s to build; this is the compute floor of the actor's step).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import torch

from verl_ds.data.tiny import build_tiny_llama
from verl_ds.dist import on_gpu
from verl_ds.ds_config import run_precision
from verl_ds.rollout import HFRollout, VLLMRollout, resolve_eager
from verl_ds.rollout.seeding import prompt_seeds


def _model_dir(cfg, tmp: str) -> str:
    if cfg.model.path != "tiny":
        return cfg.model.path

    t = cfg.model.tiny
    return str(
        build_tiny_llama(Path(tmp) / "tiny", hidden=t.hidden, layers=t.layers, heads=t.heads, ffn=t.ffn, seed=t.seed)
    )


def _prompts(model_path: str, count: int, length: int, seed: int) -> list[list[int]]:
    """Random non-special token ids after bos: generation speed does not depend on their meaning."""
    hf = json.loads((Path(model_path) / "config.json").read_text())
    rng = random.Random(seed)
    bos = hf.get("bos_token_id")
    first = [bos] if isinstance(bos, int) else []
    return [first + [rng.randrange(4, hf["vocab_size"]) for _ in range(length - len(first))] for _ in range(count)]


def _time_gen(rollout, prompts, rc, reps: int) -> float:
    """Tokens/s over `reps` timed calls after one warm-up call."""
    kw = dict(n=rc.n, temperature=rc.temperature, top_p=rc.top_p, max_new_tokens=rc.max_new_tokens)
    rollout.generate(prompts, **kw, seeds=prompt_seeds(0, 0, range(len(prompts))))
    tokens = seconds = 0.0
    for i in range(reps):
        batch = rollout.generate(prompts, **kw, seeds=prompt_seeds(0, i + 1, range(len(prompts))))
        tokens += float(batch.response_mask.sum())
        seconds += rollout.last_metrics["timing_s/gen"]
    return tokens / seconds


def _time_train_step(model_path: str, batch_size: int, seq_len: int, reps: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = torch.randint(4, model.config.vocab_size, (batch_size, seq_len))
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step allocates optimizer state
            times.append(time.perf_counter() - t0)
    return sum(times) / len(times)


def bench_rollout(cfg, reps: int = 3) -> dict[str, float]:
    """(A benchmark program read top to bottom: each engine timed in turn, then the ratios.)
    Print and return tokens/s (vLLM, HF, ratio) and sync vs train-step seconds."""

    rc = cfg.rollout
    dtype = run_precision(cfg).rollout
    with tempfile.TemporaryDirectory(prefix="verl_ds_bench_") as tmp:
        path = _model_dir(cfg, tmp)
        plen = min(16, cfg.data.max_prompt_length)
        prompts = _prompts(path, cfg.trainer.prompts_per_step, plen, cfg.trainer.seed)

        t0 = time.perf_counter()
        hf = HFRollout(path, dtype)
        hf_start_s = time.perf_counter() - t0
        hf_tps = _time_gen(hf, prompts, rc, reps)
        weights = [(n, p.detach().clone()) for n, p in hf.model.named_parameters()]
        hf.shutdown()
        train_s = _time_train_step(path, len(prompts) * rc.n, plen + rc.max_new_tokens, reps)

        vl = VLLMRollout(
            path,
            dtype,
            max_model_len=rc.max_model_len,
            kv_cache_gb=rc.kv_cache_gb,
            enforce_eager=resolve_eager(rc.enforce_eager, on_gpu()),
            bucket_mb=rc.bucket_mb,
            seed=cfg.trainer.seed,
            gpu_memory_utilization=rc.gpu_memory_utilization,
            sleep=False,
        )
        start_s = vl.start_s
        try:
            vllm_tps = _time_gen(vl, prompts, rc, reps)
            sync_s = sum(vl.sync_weights(weights)["timing_s/update_weights"] for _ in range(reps)) / reps
        finally:
            vl.shutdown()

    out = {
        "bench/vllm_tokens_per_s": vllm_tps,
        "bench/hf_tokens_per_s": hf_tps,
        "bench/vllm_over_hf": vllm_tps / hf_tps,
        "bench/vllm_start_s": start_s,
        "bench/hf_start_s": hf_start_s,
        "bench/sync_s": sync_s,
        "bench/train_step_s": train_s,
        "bench/sync_over_train_step": sync_s / train_s,
    }
    n_params = sum(t.numel() for _, t in weights)
    print(
        f"model {cfg.model.path} ({n_params / 1e6:.2f}M params, {dtype}); {len(prompts)} prompts x n={rc.n}, "
        f"{plen} prompt tokens, up to {rc.max_new_tokens} new, T={rc.temperature}"
    )
    print(
        f"generate  vLLM {vllm_tps:10.0f} tok/s   HF {hf_tps:10.0f} tok/s   ratio {vllm_tps / hf_tps:6.2f}x "
        f"(start: vLLM {start_s:.1f} s in-process, HF {hf_start_s:.1f} s)"
    )
    print(
        f"sync      {sync_s * 1e3:8.1f} ms   vs train step {train_s * 1e3:8.1f} ms "
        f"(plain torch AdamW fwd/bwd/step, {len(prompts) * rc.n} x {plen + rc.max_new_tokens} tokens)   "
        f"share {100 * sync_s / train_s:.1f}%"
    )
    return out
