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
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


@contextmanager
def _quiet_partial_reload():
    # a filter, not setLevel: every setLevel clears the cache of every logger in the process
    # (thousands with torch + vLLM), 40% of a small model's sync
    loggers = [logging.getLogger(n) for n in _RELOAD_LOGGERS]
    for lg in loggers:
        lg.addFilter(_errors_only)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(_errors_only)


class WeightSyncExtension:
    def load_named_tensors(self, named) -> int:
        """Load one bucket of `(hf_name, tensor)` pairs; returns the tensor count."""
        named = list(named)
        with _quiet_partial_reload():
            self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        return len(named)
