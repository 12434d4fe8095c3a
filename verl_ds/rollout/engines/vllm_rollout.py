"""`VLLMRollout`: an in-process vLLM engine in every rank, sharing the trainer's process group.

Shape (TRL's colocate mode, verl's SPMD rollout): `distributed_executor_backend="external_launcher"`
makes vLLM reuse the launcher's ranks; `tensor_parallel_size` consecutive ranks share one engine
(each holds a shard and every member runs the same requests). Prompts go in as token ids
(`skip_tokenizer_init`): the trainer owns the tokenizer. Logprobs are vLLM's *processed* logprobs
(after temperature / top-p), i.e. the distribution actually sampled. Weights come in as
`(name, tensor)` pairs on their own device and are loaded in byte-bounded buckets. On GPU the
engine sleeps while the roles train (KV cache freed; weights discarded, or kept on the host where no
sync follows); the sync wakes only the weights, generation the KV cache (`sleep`).
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import Iterable

import torch

from verl_ds.dist import init_distributed, on_gpu, rank
from verl_ds.errors import ConfigError, RunFailure
from verl_ds.precision import TORCH_DTYPES
from verl_ds.process import setup_process

from ..batch import RolloutBatch
from . import vllm_internals
from .engine import Sampled
from .weights import (
    TIED_HEAD,
    ParamChecker,
    eos_token_ids,
    fingerprint,
    layer_group,
    pad_token_id,
    same_fingerprint,
    sync_mismatch,
)

log = logging.getLogger(__name__)


class VLLMRollout:
    def __init__(
        self,
        model_path: str,
        dtype: str = "fp32",
        *,
        tensor_parallel_size: int = 1,
        max_model_len: int = 256,
        kv_cache_gb: float = 0.25,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        bucket_mb: int = 256,
        block_size: int = 0,
        seed: int = 0,
        sleep: bool = True,
        trust_remote_code: bool = False,
        lm_head_fp32: bool = False,
    ):
        """(Long on purpose: vLLM's engine arguments, each stated where the engine is built.)"""
        init_distributed()  # external_launcher joins the process group the roles use
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"rollout dtype {dtype!r}: expected one of {', '.join(TORCH_DTYPES)}")
        self.model_path, self.dtype, self.tp = str(model_path), dtype, tensor_parallel_size
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.checker = ParamChecker(model_path)  # names/shapes read once from the headers
        self.eos_ids = eos_token_ids(model_path)
        self.pad_id = pad_token_id(model_path)
        self.cuda = on_gpu()
        self.sleeps = sleep and self.cuda
        if sleep and not self.cuda:
            log.info("vLLM sleep mode is unavailable on CPU: the engine keeps its weights and KV cache")
        self.weights = "awake"  # | "host" (sleep level 1) | "gone" (level 2: a sync must load them)
        self.kv_awake = True
        self.last_metrics: dict[str, float] = {}
        kwargs = dict(
            model=self.model_path,
            dtype=str(TORCH_DTYPES[dtype]).removeprefix("torch."),  # vLLM's names: float32, bfloat16, ...
            skip_tokenizer_init=True,
            trust_remote_code=trust_remote_code,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="external_launcher",
            logprobs_mode="processed_logprobs",
            worker_extension_cls="verl_ds.rollout.engines.worker_ext.WeightSyncExtension",
        )
        if block_size:  # CPU attention runs per block: 128-token blocks waste work on short rollouts
            kwargs["block_size"] = block_size
        if lm_head_fp32:  # vLLM's own switch: the lm_head projection and logits in fp32
            kwargs["hf_overrides"] = {"head_dtype": "float32"}
        if self.cuda:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=sleep)
        else:
            # No chunked prefill on CPU: vLLM rewinds a seeded request's generator when it discards
            # a partial prefill's sample, and CPU generators have no offset (RuntimeError as soon as
            # one step's prompts pass max_num_batched_tokens).
            kwargs.update(
                kv_cache_memory_bytes=int(kv_cache_gb * 2**30),
                enable_chunked_prefill=False,
                max_num_batched_tokens=max(max_model_len, 4096),
            )
        self.start_s = 0.0
        self.llm = self._start(kwargs, gpu_memory_utilization, enforce_eager)
        self.version = 0  # syncs loaded; the engine's workers record the one they last loaded
        self.checked = self._checkable()

    def _checkable(self) -> list[str]:
        """The parameters a sync is verified on: those the engine serves under their checkpoint name
        and with the checkpoint's values (vLLM fuses q/k/v and gate/up, shards under tensor
        parallelism, may repack), found once at start against the checkpoint it loaded."""
        from safetensors import safe_open

        _, live = self.llm.collective_rpc("fingerprints", args=(list(self.checker.expected),))[0]
        device, dt = "cuda" if self.cuda else "cpu", TORCH_DTYPES[self.dtype]
        out = []
        for f in sorted(Path(self.model_path).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    if k in live and same_fingerprint(live[k], fingerprint(sf.get_tensor(k).to(device, dt))):
                        out.append(k)
        return out

    def _start(self, kwargs: dict, gpu_util: float, eager: bool):
        from vllm import LLM

        vllm_internals.reset_envs_cache()  # an earlier in-process engine froze vllm.envs: re-read them
        # thread binding, compile off (CPU), stale shm, GC heap frozen: one logged call (process.py)
        setup_process(rank=rank(), cpu=not self.cuda, eager=eager, tensor_parallel=self.tp)
        t0 = time.perf_counter()
        try:
            llm = LLM(**kwargs)
        except (RuntimeError, ValueError) as e:
            if self.cuda and "memory" in str(e).lower():
                free, total = torch.cuda.mem_get_info()
                raise ConfigError(
                    "rollout.gpu_memory_utilization",
                    f"vLLM could not get its memory: {free / 2**30:.1f} GiB free of "
                    f"{total / 2**30:.1f} GiB, it needs {gpu_util:.2f} x {total / 2**30:.1f} = "
                    f"{gpu_util * total / 2**30:.1f} GiB ({e})",
                ) from None
            raise
        self.start_s = time.perf_counter() - t0
        log.info("vLLM engine up in %.1f s (%s, TP=%d, in-process)", self.start_s, self.dtype, self.tp)
        return llm

    # ---------------------------------------------------------------- generation
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 16,
        seeds: list[int] | None = None,
        top_k: int = 0,
    ) -> RolloutBatch:
        """`n` samples per prompt, contiguous per prompt (`group_ids` index the prompts). `seeds[i]`
        seeds prompt i's samples (see seeding.py); None: the engine's own RNG. Every member of a
        tensor-parallel group must call it with the same arguments."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.wake_up()
        prompts = [list(map(int, p)) for p in prompt_token_ids]
        greedy = temperature <= 0  # vLLM refuses n > 1 when greedy: send n copies of n=1 instead
        reqs = [i for i in range(len(prompts)) for _ in range(n if greedy else 1)]
        params = [
            SamplingParams(
                n=1 if greedy else n,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_tokens=max_new_tokens,
                logprobs=0,
                stop_token_ids=self.eos_ids,
                detokenize=False,
                seed=None if seeds is None else int(seeds[i]),
            )
            for i in reqs
        ]
        t0 = time.perf_counter()
        outs = (
            self.llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in reqs], params, use_tqdm=False)
            if reqs
            else []
        )
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

    def stream(self, temperature: float, top_p: float, chunk_tokens: int, top_k: int = 0) -> VLLMStream:
        """Step-and-abort on this engine (`chunk_tokens` unused: it stops between any two steps)."""
        self.wake_up()
        return VLLMStream(self, temperature, top_p, top_k)

    # ---------------------------------------------------------------- GPU memory hand-off
    # vLLM sized its KV pool at start-up, before the roles' Adam states existed: the pool comes back
    # only for generation (`wake_up`), after the roles slept, never in the sync, where every role is
    # still awake (the sync stage of `diagnostics/memory`'s model: vLLM's weights only).
    def sleep(self, level: int) -> None:
        """GPU: free the KV cache and the weights for the roles. `level` 2 discards the weights (a
        sync loads new ones before the next generation: after a step's generation); 1 keeps a host
        copy for a generation that comes without a sync (after validation)."""
        if self.sleeps and (self.weights == "awake" or self.kv_awake):
            self.llm.sleep(level=level)
            torch.cuda.empty_cache()
            self.weights, self.kv_awake = ("host" if level == 1 else "gone"), False

    def wake_up(self) -> None:
        """Before generating: the weights (unless a sync brought them) and the KV cache."""
        if self.weights == "gone":
            raise RuntimeError("vLLM's weights were discarded (sleep level 2): sync weights before generating")
        self._wake_weights()
        if not self.kv_awake:
            self.llm.wake_up(tags=["kv_cache"])
            self.kv_awake = True

    def _wake_weights(self) -> None:
        if self.weights != "awake":
            self.llm.wake_up(tags=["weights"])
            self.weights = "awake"

    def memory_bytes(self) -> dict[str, float]:
        """What the engine holds now (`memory/<stage>/rollout/*`): its weights by dtype and its KV cache
        pool, each only while awake (asleep, vLLM has released that memory)."""
        held = self.llm.collective_rpc("memory_bytes")[0]
        awake = {k: self.kv_awake if k == "kv_cache" else self.weights == "awake" for k in held}
        return {k: v for k, v in held.items() if awake[k]}

    # ---------------------------------------------------------------- weight sync
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Load new weights in place, in buckets of ~bucket_mb (split only between layers), each
        tensor cast on its own device. Every tensor is checked (name, shape) before it joins a
        bucket, and missing names before the last bucket is loaded: a model that fits one bucket is
        fully validated before the engine is touched. A ValueError after some buckets were loaded
        (models larger than one bucket) leaves a mix of old and new weights until the next sync.
        On GPU only the weights wake (the KV cache waits for `generate`, after the roles slept).
        Then the check that it happened: the `checked` parameters' fingerprints read back from the
        serving model must equal those of what was sent, and the engine must have loaded this very
        sync; a RunFailure names the parameter otherwise (`timing_s/sync_check`: its cost)."""
        t0 = time.perf_counter()
        self._wake_weights()
        dt = TORCH_DTYPES[self.dtype]
        self.version += 1
        want, check_s = {}, 0.0
        self.checker.begin()
        bucket, nbytes, group, n_buckets = [], 0, None, 0
        for name, tensor in named_tensors:
            if not self.checker.check(name, tensor):
                continue
            size = tensor.numel() * dt.itemsize
            g = layer_group(name)
            if bucket and g != group and nbytes + size > self.bucket_bytes:
                self._load(bucket)
                bucket, nbytes, n_buckets = [], 0, n_buckets + 1
            cast = tensor.detach().to(dtype=dt).contiguous()
            if name in self.checked:
                t = time.perf_counter()
                want[name] = fingerprint(cast)
                check_s += time.perf_counter() - t
            bucket.append((name, cast))
            nbytes, group = nbytes + size, g
            if self.checker.tied and name == self.checker.tied_source:
                # vLLM 0.32's layerwise reload restores each layer separately: a tied lm_head
                # that receives nothing keeps the OLD embedding. Send it, in the same bucket.
                bucket.append((TIED_HEAD, cast))
        self.checker.finish()
        if bucket:
            self._load(bucket)
            n_buckets += 1
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        t = time.perf_counter()
        got_version, got = self.llm.collective_rpc("fingerprints", args=(list(want),))[0]
        if problem := sync_mismatch(self.version, got_version, got, want):
            raise RunFailure(f"weight sync: {problem}")
        return {
            "timing_s/update_weights": time.perf_counter() - t0,
            "timing_s/sync_check": check_s + time.perf_counter() - t,
            "rollout/sync_buckets": float(n_buckets),
            "rollout/sync_checked_params": float(len(want)),
        }

    def _load(self, bucket: list) -> None:
        self.llm.collective_rpc("load_named_tensors", args=(bucket, self.version))

    def shutdown(self, release: bool = True) -> None:
        """Tear the engine down; `release=False` when the process is about to exit: vLLM's teardown
        (process groups, two full garbage collections: ~2.5 s per rank) would only free memory the
        OS reclaims anyway, so its exit-time finalizer is dropped too."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        if not release:
            vllm_internals.drop_exit_finalizer(llm)
            return
        try:
            vllm_internals.shutdown_engine(llm)
        except Exception as e:  # an already-dead engine may refuse; nothing to release then
            log.debug("vLLM shutdown: %s", e)
        del llm
        gc.collect()


class VLLMStream:
    """A `TokenStream` on the in-process engine: requests queued with their own seeds and
    budgets, the engine stepped one decode step at a time, each request's new tokens and logprobs
    kept as they come, and on `close` the requests still running aborted with what they sampled.
    Requests added between steps join the running batch (continuous batching). One engine, one
    rank: a tensor-parallel group's members would have to add identical requests."""

    def __init__(self, engine: VLLMRollout, temperature: float, top_p: float, top_k: int = 0):
        self.engine, self.temperature, self.top_p, self.top_k = engine, temperature, top_p, top_k
        self.running: dict[str, Sampled] = {}
        self.steps, self.peak, self.seconds, self.tokens, self._n = 0, 0, 0.0, 0, 0

    def add(self, keys: list, context: list[int], max_new_tokens: int, seed: int) -> None:
        from vllm import SamplingParams

        for j, key in enumerate(keys):
            params = SamplingParams(
                n=1,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                max_tokens=max_new_tokens,
                logprobs=0,
                stop_token_ids=self.engine.eos_ids,
                detokenize=False,
                seed=int(seed) + j,
            )
            rid, self._n = f"stream-{self._n}", self._n + 1
            vllm_internals.add_streamed_request(self.engine.llm, rid, list(map(int, context)), params)
            self.running[rid] = Sampled(key, [], [], "")
        self.peak = max(self.peak, len(self.running))

    def step(self) -> list[Sampled]:
        t0 = time.perf_counter()
        outs = vllm_internals.step_engine(self.engine.llm)
        self.seconds += time.perf_counter() - t0
        self.steps += 1
        ended = []
        for out in outs:
            got, c = self.running[out.request_id], out.outputs[0]
            new = list(c.token_ids)
            got.ids += new
            got.logprobs += [lp[t].logprob for t, lp in zip(new, c.logprobs)]
            self.tokens += len(new)
            if out.finished:
                got.finish = c.finish_reason if c.finish_reason in ("stop", "length") else "length"
                ended.append(self.running.pop(out.request_id))
        return ended

    def close(self) -> list[Sampled]:
        vllm_internals.abort_requests(self.engine.llm, list(self.running))
        cut = list(self.running.values())
        for got in cut:
            got.finish = "abort"
        self.running = {}
        self.engine.last_metrics = {
            "timing_s/gen": self.seconds,
            "perf/rollout_tokens_per_s": self.tokens / max(self.seconds, 1e-9),
        }
        return cut

    def __len__(self) -> int:
        return len(self.running)
