"""Int8 (weight-only) frozen roles: torchao's int8 weight-only Linear on every device, applied to a
role's engine after `deepspeed.initialize`, and the byte count that sees quantized weights."""

from __future__ import annotations

import logging

import torch

from verl_ds.errors import ConfigError
from verl_ds.roles.ds_internals import storage_tensors, torch_linear

log = logging.getLogger(__name__)


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters and buffers by storage: a quantized weight counts its int8 data and scales."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(s.numel() * s.element_size() for t in tensors for s in storage_tensors(t))


class Int8Linear(torch.nn.Linear):
    """A Linear whose weight is torchao's int8 tensor. It calls torch's linear op itself: the one
    `nn.Linear` finds, once a ZeRO-3 role exists in the process, is DeepSpeed's wrapper
    (`torch_linear`), which transposes the weight, an op torchao's int8 tensor does not implement."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_linear(x, self.weight, self.bias)


def quantize_int8(module: torch.nn.Module, role: str) -> None:
    """In place, a frozen role's plain Linear weights -> torchao int8 weight-only (per output row
    scales; activations stay in the module's dtype), the modules -> `Int8Linear`, with one log line
    of the bytes saved. Run on the engine's module after `deepspeed.initialize`, which moves every
    parameter to the device (for a wrapper subclass a tensor swap, refused once DeepSpeed holds a
    weak reference to it) and broadcasts each one viewed as uint8 bytes (which torchao's int8 tensor
    does not implement). An fp32 LM head (`FP32LMHead`, a Linear subclass) stays as the role asked."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise ConfigError(f"precision.{role}_dtype", "int8 needs torchao (pip install torchao)") from None
    before = tensor_bytes(module)
    linears = [m for m in module.modules() if type(m) is torch.nn.Linear]
    quantize_(module, Int8WeightOnlyConfig(), filter_fn=lambda m, _fqn: type(m) is torch.nn.Linear)
    for m in linears:
        m.__class__ = Int8Linear  # by class, as `FP32LMHead`: parameters and hooks stay the module's
    after = tensor_bytes(module)
    log.info(
        "int8 %s: %.2f MB -> %.2f MB (%.1f%% saved)", role, before / 2**20, after / 2**20, 100 * (1 - after / before)
    )
