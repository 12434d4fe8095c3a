"""Stream a DeepSpeed engine's full weights as plain HF `(name, tensor)` pairs, one module at a time."""
from __future__ import annotations

import shutil
from contextlib import nullcontext
from pathlib import Path
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


def export_hf(engine, out_dir: str | Path, dtype: str, tokenizer=None) -> Path:
    """Save the engine's model as an HF directory (safetensors, config dtype set). All ranks must
    call it (ZeRO-3 gathers are collective); only rank 0 keeps tensors and writes. The new directory
    is written beside the old one and swapped in by renames, so a reader never sees a partial one."""
    from verl_ds.precision import TORCH_DTYPES
    from verl_ds.dist import barrier, rank

    out = Path(out_dir)
    keep = rank() == 0
    sd = {}
    for name, t in iter_full_params(engine):
        if keep:
            sd[name] = t.to(device="cpu", dtype=TORCH_DTYPES[dtype])
    if keep:
        module = getattr(engine, "module", engine)
        tmp, old = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")
        shutil.rmtree(tmp, ignore_errors=True)
        module.config.dtype = TORCH_DTYPES[dtype]   # transformers 5 name (was torch_dtype)
        module.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return out
