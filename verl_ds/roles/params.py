"""Stream a DeepSpeed engine's full weights as plain HF `(name, tensor)` pairs, one module at a time."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import torch

from verl_ds.dist import barrier, rank
from verl_ds.precision import TORCH_DTYPES
from verl_ds.roles.ds_internals import is_zero3, iter_gathered
from verl_ds.roles.lora import adapter_state_dict, is_lora_model, iter_merged_params


def iter_full_params(engine_or_module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full_tensor)` for every parameter, at any ZeRO stage.

    Under ZeRO-3 each module's partitions are gathered (`ds_internals.iter_gathered`) only while
    that module's tensors are yielded (copies are made, since the gather is released after), so the
    whole model is never held twice. A tied parameter (embeddings / lm_head) is yielded once, under
    its first name, as `model.named_parameters()` does. Names carry no `module.` prefix.
    """
    module = getattr(engine_or_module, "module", engine_or_module)
    if is_lora_model(module):  # a LoRA actor streams its merged weights under the base's names
        yield from iter_merged_params(module)
        return
    stage3 = is_zero3(module)
    for mod_name, _, own in iter_gathered(module, zero3=stage3):
        for name, p in own:
            full = f"{mod_name}.{name}" if mod_name else name
            yield full, (p.data.detach().clone() if stage3 else p.data.detach())


def export_hf(engine, out_dir: str | Path, dtype: str, tokenizer=None) -> Path:
    """Save the engine's model (a LoRA actor: merged) as an HF directory (safetensors, config dtype
    set). All ranks must call it (ZeRO-3 gathers are collective); only rank 0 keeps tensors and writes."""
    keep = rank() == 0
    sd = {name: t.to(device="cpu", dtype=TORCH_DTYPES[dtype]) for name, t in iter_full_params(engine) if keep}
    module = getattr(engine, "module", engine)
    model = module.get_base_model() if is_lora_model(module) else module

    def write(tmp: Path) -> None:
        model.config.dtype = TORCH_DTYPES[dtype]  # transformers 5 name (was torch_dtype)
        model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    return write_dir_atomically(out_dir, write)


def export_adapter(engine, out_dir: str | Path, tokenizer=None) -> Path:
    """A LoRA actor's adapter in peft's format (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    sd = adapter_state_dict(engine)
    module = getattr(engine, "module", engine)

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        module.peft_config["default"].save_pretrained(str(tmp))
        save_file(sd, str(tmp / "adapter_model.safetensors"))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    return write_dir_atomically(out_dir, write)


def write_dir_atomically(out_dir: str | Path, write) -> Path:
    """Rank 0 runs `write(tmp)` beside `out_dir` and swaps it in (`swap_in`), so a reader never sees
    a partial directory; every rank waits for it."""
    out = Path(out_dir)
    if rank() == 0:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
        swap_in(tmp, out)
    barrier()
    return out


def swap_in(tmp: str | Path, final: str | Path) -> Path:
    """Replace directory `final` by the complete directory `tmp` by renames (`final` -> `<tmp
    without .tmp>.old`, `tmp` -> `final`, the old one removed): at every moment `final` is the old
    directory or the new one, never a partial one. One process calls it (rank 0)."""
    tmp, final = Path(tmp), Path(final)
    old = tmp.with_name(tmp.name.removesuffix(".tmp") + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final
