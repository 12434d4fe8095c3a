"""Int8 (weight-only) frozen roles: the quantization and the byte count that sees packed weights."""

from __future__ import annotations

import logging

import torch

from verl_ds.errors import ConfigError
from verl_ds.precision import TORCH_DTYPES
from verl_ds.roles.ds_internals import packed_weight_bias

log = logging.getLogger(__name__)


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters and buffers, including packed quantized weights."""
    total = sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
    for m in module.modules():
        packed = packed_weight_bias(m)
        if packed is not None:
            w, b = packed
            total += w.numel() * w.element_size() + (b.numel() * b.element_size() if b is not None else 0)
    return total


def quantize_int8(model: torch.nn.Module, activation_dtype: str, role: str) -> torch.nn.Module:
    """A frozen role's Linear weights -> int8 (one log line with the bytes saved). CPU: torch.ao
    dynamic quantization (int8 weights, activations quantized per batch; the rest of the model stays
    fp32). CUDA: torchao int8 weight-only, activations in `activation_dtype`."""
    before = tensor_bytes(model)
    if torch.cuda.is_available():
        try:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
        except ImportError:
            raise ConfigError(f"precision.{role}_dtype", "int8 on GPU needs torchao (pip install torchao)") from None
        model = model.to(device="cuda", dtype=TORCH_DTYPES.get(activation_dtype, torch.bfloat16))
        quantize_(model, Int8WeightOnlyConfig())
    else:
        if activation_dtype != "fp32":
            log.warning("int8 %s on CPU: dynamic quantization runs fp32 activations, not %s", role, activation_dtype)
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    after = tensor_bytes(model)
    log.info(
        "int8 %s: %.2f MB -> %.2f MB (%.1f%% saved)", role, before / 2**20, after / 2**20, 100 * (1 - after / before)
    )
    return model
