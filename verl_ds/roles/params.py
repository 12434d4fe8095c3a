"""Stream a DeepSpeed engine's full weights as plain HF `(name, tensor)` pairs, one module at a time."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Iterator

import torch


def iter_full_params(engine_or_module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full_tensor)` for every parameter, at any ZeRO stage.

    Under ZeRO-3 each module's partitions are gathered with `GatheredParameters` only while that
    module's tensors are yielded (copies are made, since the gather is released after), so the
    whole model is never held twice. A tied parameter (embeddings / lm_head) is yielded once, under
    its first name, as `model.named_parameters()` does. Names carry no `module.` prefix.
    """
    import deepspeed

    module = getattr(engine_or_module, "module", engine_or_module)
    stage3 = any(hasattr(p, "ds_id") for p in module.parameters())
    seen: set[int] = set()
    for mod_name, mod in module.named_modules():
        own = [(n, p) for n, p in mod.named_parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for _, p in own)
        ctx = deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=None) if stage3 else nullcontext()
        with ctx:
            for name, p in own:
                full = f"{mod_name}.{name}" if mod_name else name
                yield full, (p.data.detach().clone() if stage3 else p.data.detach())
