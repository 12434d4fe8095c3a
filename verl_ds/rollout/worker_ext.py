"""A method mixed into vLLM's worker (`worker_extension_cls`) to load new weights in place.

The engine runs in this process (`external_launcher`), so `collective_rpc` hands the worker the
tensors themselves, on their own device: no serialization, no file. The worker's `reload_weights(...,
is_checkpoint_format=True)` (through `vllm_internals.reload_weights`) takes HF names and re-runs
vLLM's own weight processing (fused qkv / gate_up, tensor-parallel sharding, tied embeddings).
"""

from __future__ import annotations

from .vllm_internals import reload_weights


class WeightSyncExtension:
    def load_named_tensors(self, named) -> int:
        """Load one bucket of `(hf_name, tensor)` pairs; returns the tensor count."""
        named = list(named)
        reload_weights(self, named)
        return len(named)
