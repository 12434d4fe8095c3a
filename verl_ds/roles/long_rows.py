"""Long-row memory from DeepSpeed's ALST: `TiledMLP` on a model's decoder MLPs (`roles.<role>.tiled_mlp`),
and the checkpointed layers' inputs offloaded to host memory (`roles.<role>.offload_activations`).

A SwiGLU MLP holds `[tokens, ffn]` intermediates (gate, up, their activation and product), ~2.7x a layer's
hidden-sized ones at Llama's widths; DeepSpeed's `TiledMLP` runs it in tiles along the sequence without
grad, keeps only its input, and recomputes tile by tile in the backward. Per token the MLP is the same
function, so the outputs are the untiled ones (up to the GEMMs' blocking) and the weight gradients their
sum over the tiles.
"""

from __future__ import annotations

import math
import types

import torch

from verl_ds.roles.ds_internals import is_zero3


def tile_mlps(model: torch.nn.Module) -> int:
    """Every gated MLP of `model` (`gate_proj`, `up_proj`, `down_proj`, `act_fn`: Llama, Qwen, Mistral, ...)
    runs through `TiledMLP`; -> how many. None found is an error (the setting would do nothing)."""
    mlps = [m for m in model.modules() if all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))]
    if not mlps:
        raise ValueError(f"{type(model).__name__}: tiled_mlp found no gated MLP (gate_proj/up_proj/down_proj)")
    for m in mlps:
        m.forward = types.MethodType(_tiled_forward, m)
    return len(mlps)


def _mlp(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _tiled_forward(self, x: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's tiles: as many as `hidden`-token slices of the sequence. Under ZeRO-3 each tile's
    projections gather their weights, so every rank takes the largest count (their gathers match)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    weights = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
    shards = math.ceil(x.shape[-2] / x.shape[-1])
    if is_zero3(self) and torch.distributed.is_initialized():
        n = torch.tensor(shards, device=x.device)
        torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX)
        shards = int(n)
    # a tile a token at most (`torch.chunk` would make fewer: a rank this short under ZeRO-3 would run
    # fewer gathers than its peers, so keep rows of one micro-batch of similar lengths there)
    shards = min(shards, x.shape[-2])
    if shards <= 1:
        return _mlp(self, x)
    return TiledMLP.apply(_mlp, self, x, shards, weights)


def activation_offload(on_gpu: bool):
    """DeepSpeed's offload of the inputs gradient checkpointing keeps (one per decoder layer) to host memory
    from the forward until the backward needs them (`CheckpointHiddenStatesOffload`, pinned buffers on a
    side stream on a GPU), as a context to hold over one micro-batch's forward and backward. On a CPU
    DeepSpeed marks the inputs and keeps them where they are (the host already holds them)."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )

    return get_checkpoint_hidden_states_offloading_ctx_manager(use_pin_memory=on_gpu, use_streams=on_gpu)
