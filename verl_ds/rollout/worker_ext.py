"""A method mixed into vLLM's worker (`worker_extension_cls`) to load new weights in place.

The engine runs in this process (`external_launcher`), so `collective_rpc` hands the worker the
tensors themselves, on their own device: no serialization, no file. `reload_weights(...,
is_checkpoint_format=True)` takes HF names and re-runs vLLM's own weight processing (fused qkv /
gate_up, tensor-parallel sharding, tied embeddings).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager

# A bucket holds only some layers by design; vLLM warns about every layer a reload did not touch.
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")


@contextmanager
def _quiet_partial_reload():
    loggers = [logging.getLogger(n) for n in _RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


class WeightSyncExtension:
    def load_named_tensors(self, named) -> int:
        """Load one bucket of `(hf_name, tensor)` pairs; returns the tensor count."""
        named = list(named)
        with _quiet_partial_reload():
            self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        return len(named)
