"""Methods mixed into vLLM's worker (`worker_extension_cls`): load new weights in place, read them
back, and say what the engine holds.

The engine runs in this process (`external_launcher`), so `collective_rpc` hands the worker the
tensors themselves, on their own device: no serialization, no file. The worker's `reload_weights(...,
is_checkpoint_format=True)` (through `vllm_internals.reload_weights`) takes HF names and re-runs
vLLM's own weight processing (fused qkv / gate_up, tensor-parallel sharding, tied embeddings).
"""

from __future__ import annotations

from verl_ds.precision import dtype_name

from .vllm_internals import kv_cache_tensors, live_model, reload_weights
from .weights import fingerprint


class WeightSyncExtension:
    weights_version = 0  # the sync whose last bucket this worker loaded

    def load_named_tensors(self, named, version: int = 0) -> int:
        """Load one bucket of `(hf_name, tensor)` pairs of sync `version`; returns the tensor count."""
        named = list(named)
        reload_weights(self, named)
        self.weights_version = version
        return len(named)

    def fingerprints(self, names) -> tuple[int, dict]:
        """(the version last loaded, {name: `fingerprint`} of the live model's parameters among
        `names`): read back from the model that serves, after the sync."""
        params = dict(live_model(self).named_parameters())
        return self.weights_version, {n: fingerprint(params[n]) for n in names if n in params}

    def memory_bytes(self) -> dict[str, float]:
        """Bytes this worker's engine holds, each storage once: its weights by dtype and its KV cache
        pool (`memory/<stage>/rollout/*`). The weights are the served model's parameters: on vLLM's
        CPU backend the linear weights it repacked into oneDNN's layout are not among them."""
        out: dict[str, float] = {}
        seen: set[int] = set()
        tensors = [(f"weights_{dtype_name(p.dtype)}", p) for p in live_model(self).parameters()]
        for key, t in [*tensors, *(("kv_cache", t) for t in kv_cache_tensors(self))]:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[key] = out.get(key, 0.0) + float(storage.nbytes())
        return out
