"""Methods mixed into vLLM's worker (`worker_extension_cls`) to load new weights in place.

In multiprocess mode `collective_rpc` cannot carry tensors (they arrive as lists) nor functions,
so the driver writes a safetensors bucket to /dev/shm and the worker reads it here. Both paths go
through the worker's `reload_weights(..., is_checkpoint_format=True)`, which takes HF names and
re-runs vLLM's own weight processing (fused qkv / gate_up, tied embeddings).
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
    def load_bucket_file(self, path: str) -> int:
        """Load one safetensors bucket written by the driver; returns the tensor count."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        with _quiet_partial_reload():
            self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)

    def load_named_tensors(self, named) -> int:
        """In-process mode: the tensors themselves (no serialization)."""
        named = list(named)
        with _quiet_partial_reload():
            self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        return len(named)
