"""`VLLMRollout`: sampling with vLLM, and in-place weight updates from a stream of HF tensors.

Prompts go in as token ids (`skip_tokenizer_init`): the trainer owns the tokenizer. Logprobs are
vLLM's *processed* logprobs (after temperature / top-p), i.e. the distribution actually sampled.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable

import torch

from .batch import RolloutBatch
from .weights import DTYPES, TIED_HEAD, ParamChecker, eos_token_ids, layer_group, pad_token_id, resolve_dtype

log = logging.getLogger(__name__)

# Set by torchrun / the deepspeed launcher; vLLM's own worker must not join the trainer's world.
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE")
_VLLM_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@contextmanager
def _env(set_: dict[str, str], scrub: tuple[str, ...] = ()):
    """Temporarily set / remove environment variables (child processes copy them at spawn)."""
    old = {k: os.environ.get(k) for k in (*set_, *scrub)}
    os.environ.update(set_)
    for k in scrub:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class VLLMRollout:
    def __init__(self, model_path: str, dtype: str = "fp32", *, max_model_len: int = 256,
                 kv_cache_gb: float = 0.25, enforce_eager: bool = True, multiprocess: bool = True,
                 bucket_mb: int = 256, seed: int = 0, gpu_memory_utilization: float = 0.5,
                 cpu_threads_bind: str | None = None, trust_remote_code: bool = False):
        self.model_path = str(model_path)
        self.dtype = resolve_dtype(dtype)
        self.multiprocess = multiprocess
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.checker = ParamChecker(model_path)   # names/shapes read once from the headers
        self.eos_ids = eos_token_ids(model_path)
        self.pad_id = pad_token_id(model_path)
        self.restarts = 0
        self.serves_all_ranks = False   # set by make_rollout in rank-0 mode
        self.last_metrics: dict[str, float] = {}
        self._llm_kwargs = dict(
            model=self.model_path, dtype=_VLLM_DTYPE[self.dtype], skip_tokenizer_init=True,
            trust_remote_code=trust_remote_code,
            enforce_eager=enforce_eager, max_model_len=max_model_len, seed=seed,
            kv_cache_memory_bytes=int(kv_cache_gb * 2**30), gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="verl_ds.rollout.worker_ext.WeightSyncExtension",
        )
        self._threads_bind = cpu_threads_bind
        self.llm = self._start()

    def _start(self):
        import vllm.envs
        from vllm import LLM

        # An in-process EngineCore freezes vllm.envs (enable_envs_cache): re-read them for this engine.
        getattr(vllm.envs, "disable_envs_cache", lambda: None)()
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if self.multiprocess else "0"}
        if self._threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self._threads_bind
        # In-process, vLLM reuses an existing default process group, so nothing to scrub there.
        scrub = _LAUNCHER_VARS if self.multiprocess else ()
        t0 = time.perf_counter()
        with _env(env, scrub):
            llm = LLM(**self._llm_kwargs)
        log.info("vLLM engine up in %.1f s (%s, %s)", time.perf_counter() - t0, self.dtype,
                 "multiprocess" if self.multiprocess else "in-process")
        return llm

    # ---------------------------------------------------------------- generation
    def generate(self, prompt_token_ids: list[list[int]], n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 16, seed: int | None = None) -> RolloutBatch:
        """`n` samples per prompt, contiguous per prompt. `seed` makes the call reproducible (prompt
        i uses seed+i so prompts do not share a random stream); None: the engine's own RNG."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [list(map(int, p)) for p in prompt_token_ids]
        greedy = temperature <= 0     # vLLM refuses n > 1 when greedy: send n copies of n=1 instead
        reqs = [i for i in range(len(prompts)) for _ in range(n if greedy else 1)]
        params = [SamplingParams(n=1 if greedy else n, temperature=temperature, top_p=top_p,
                                 max_tokens=max_new_tokens, logprobs=0, stop_token_ids=self.eos_ids,
                                 detokenize=False, seed=None if seed is None else seed + i) for i in reqs]
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in reqs], params,
                                 use_tqdm=False) if reqs else []
        dt = time.perf_counter() - t0
        rows = dict(prompts=[], responses=[], logprobs=[], finish_reasons=[], group_ids=[])
        for i, out in zip(reqs, outs):
            for c in out.outputs:
                toks = list(c.token_ids)
                rows["prompts"].append(prompts[i])
                rows["responses"].append(toks)
                rows["logprobs"].append([lp[t].logprob for t, lp in zip(toks, c.logprobs)])
                rows["finish_reasons"].append(c.finish_reason or "length")
                rows["group_ids"].append(i)
        batch = RolloutBatch.from_lists(**rows, pad_id=self.pad_id)
        ntok = float(batch.response_mask.sum())
        self.last_metrics = {"timing_s/gen": dt, "perf/rollout_tokens_per_s": ntok / max(dt, 1e-9)}
        return batch

    # ---------------------------------------------------------------- weight sync
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Load new weights in place, in buckets of ~bucket_mb (split only between layers).

        Every tensor is checked (name, shape) before it joins a bucket, and missing names before the
        last bucket is loaded: a model that fits one bucket is fully validated before the engine is
        touched, and a ValueError leaves the engine serving. Loaded buckets are kept (in /dev/shm,
        or as tensors in-process) until the sync ends, so an engine that dies mid-reload is rebuilt
        from the original checkpoint and the whole update replayed into it: this process holds at
        most one bucket, /dev/shm one copy of the update while the sync runs. A ValueError after
        some buckets were loaded (models larger than one bucket) leaves a mix of old and new
        weights serving until the next complete sync. `rollout/engine_restarts` counts since start.
        """
        t0 = time.perf_counter()
        dt = DTYPES[self.dtype]
        self.checker.begin()
        staged: list = []
        stage_dir = None if not self.multiprocess else tempfile.mkdtemp(
            prefix="verl_ds_sync_", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        bucket, nbytes, group = [], 0, None
        try:
            for name, tensor in named_tensors:
                if not self.checker.check(name, tensor):
                    continue
                size = tensor.numel() * dt.itemsize
                g = layer_group(name)
                if bucket and g != group and nbytes + size > self.bucket_bytes:
                    self._flush(bucket, staged, stage_dir)
                    bucket, nbytes = [], 0
                cast = tensor.detach().to("cpu", dt).contiguous()
                bucket.append((name, cast))
                nbytes, group = nbytes + size, g
                if self.checker.tied and name == self.checker.tied_source:
                    # vLLM 0.32's layerwise reload restores each layer separately: a tied lm_head
                    # that receives nothing keeps the OLD embedding. Send it, in the same bucket.
                    bucket.append((TIED_HEAD, cast.clone()))
                    nbytes += size
            self.checker.finish()
            if bucket:
                self._flush(bucket, staged, stage_dir)
            self.llm.reset_prefix_cache()   # cached KV blocks were computed with the old weights
        finally:
            if stage_dir:
                shutil.rmtree(stage_dir, ignore_errors=True)
        return {"timing_s/update_weights": time.perf_counter() - t0,
                "rollout/engine_restarts": float(self.restarts),
                "rollout/sync_buckets": float(len(staged))}

    def _flush(self, bucket: list, staged: list, stage_dir: str | None) -> None:
        if stage_dir:
            from safetensors.torch import save_file
            payload = os.path.join(stage_dir, f"bucket{len(staged)}.safetensors")
            save_file(dict(bucket), payload)
        else:
            payload = bucket
        staged.append(payload)
        try:
            self._load(payload)
        except Exception as e:   # EngineDeadError, or a half-reloaded model left on meta tensors
            log.error("vLLM died while loading weights (%s: %s); restarting it from %s and "
                      "replaying %d bucket(s)", type(e).__name__, e, self.model_path, len(staged))
            self._restart()
            for p in staged:
                self._load(p)

    def _load(self, payload) -> None:
        method = "load_bucket_file" if isinstance(payload, str) else "load_named_tensors"
        self.llm.collective_rpc(method, args=(payload,))

    def _restart(self) -> None:
        self.shutdown()
        self.llm = self._start()
        self.restarts += 1

    def shutdown(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # an already-dead engine may refuse; nothing to release then
            log.debug("vLLM shutdown: %s", e)
        del llm
        import gc
        gc.collect()
