"""LoRA actors through peft: only the adapters train (and are checkpointed); the rollout engine gets
merged weights (base + scaled adapter) streamed one module at a time; the reference policy is the
actor's own engine with its adapters disabled, so no second copy of the base model exists."""

from __future__ import annotations

import re
from typing import Iterator

import torch

from verl_ds.algos import FULL, TokenDist
from verl_ds.roles.batch import TrainBatch
from verl_ds.roles.ds_internals import gathered, is_zero3, iter_gathered

_PREFIX = "base_model.model."


def apply_lora(
    model: torch.nn.Module,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: list[str],
    modules_to_save: list[str] = (),
):
    """Wrap an HF causal LM with peft LoRA adapters; the base weights are frozen except
    `modules_to_save` (trained in full, e.g. the norms)."""
    from peft import LoraConfig, get_peft_model

    # a tied model keeps a trained embedding copy tied to its head, as the rollout engine does
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return get_peft_model(
        model,
        LoraConfig(
            r=rank,
            lora_alpha=alpha,
            lora_dropout=dropout,
            target_modules=list(target_modules),
            modules_to_save=list(modules_to_save) or None,
            task_type="CAUSAL_LM",
            ensure_weight_tying=tied,
        ),
    )


def tied_embedding_targets(model: torch.nn.Module, names: list[str]) -> list[str]:
    """The `names` that hit a tied input/output embedding (the rollout engine keeps one matrix)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    ends = {
        n
        for n, mod in model.named_modules()
        if mod is model.get_input_embeddings() or mod is model.get_output_embeddings()
    }
    return [k for k in names if any(n == k or n.endswith("." + k) for n in ends)]


def is_lora_model(module: torch.nn.Module) -> bool:
    return hasattr(module, "peft_config")


def hf_name(peft_name: str) -> str:
    """`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` -> the base checkpoint's
    `model.layers.0.self_attn.q_proj.weight`."""
    name = peft_name[len(_PREFIX) :] if peft_name.startswith(_PREFIX) else peft_name
    name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)  # a trained copy of a saved module
    return name.replace(".base_layer.", ".")


def _is_lora_layer(mod: torch.nn.Module) -> bool:
    return hasattr(mod, "lora_A") and hasattr(mod, "base_layer")


def _saved_original(mod: torch.nn.Module) -> list:
    """A modules_to_save wrapper's frozen original (never sent: its trained copy is)."""
    if hasattr(mod, "original_module") and hasattr(mod, "modules_to_save"):
        return list(mod.original_module.parameters())
    return []


def iter_merged_params(engine_or_module) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, tensor)` of the merged model (W + scaling * B @ A for every LoRA layer), one
    module at a time (`ds_internals.iter_gathered`: under ZeRO-3 only that module is gathered), and
    no merged model is ever built."""
    module = getattr(engine_or_module, "module", engine_or_module)
    for mod_name, mod, own in iter_gathered(module, whole=_is_lora_layer, drop=_saved_original):
        if not _is_lora_layer(mod):
            for name, p in own:
                yield hf_name(f"{mod_name}.{name}" if mod_name else name), p.data.detach().clone()
            continue
        with torch.no_grad():
            base = mod.base_layer
            w = base.weight.detach().clone()
            for key in mod.active_adapters:
                a, b = mod.lora_A[key].weight, mod.lora_B[key].weight
                w += (b.to(w.dtype) @ a.to(w.dtype)) * mod.scaling[key]
            yield hf_name(f"{mod_name}.base_layer.weight"), w
            if base.bias is not None:
                yield hf_name(f"{mod_name}.base_layer.bias"), base.bias.detach().clone()


def adapter_state_dict(engine_or_module) -> dict[str, torch.Tensor]:
    """The adapter tensors in peft's saved format (every rank gathers; all get the tensors)."""
    from peft import get_peft_model_state_dict

    module = getattr(engine_or_module, "module", engine_or_module)
    lora = [p for n, p in module.named_parameters() if "lora_" in n]
    with gathered(lora, is_zero3(module)):
        return {k: v.detach().clone().cpu() for k, v in get_peft_model_state_dict(module).items()}


class AdapterOffReference:
    """The reference policy of a LoRA actor: the actor's engine with its adapters disabled, i.e.
    exactly the base weights, with no second model in memory."""

    name, trainable = "reference", False

    def __init__(self, actor):
        self.actor = actor

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, dist: TokenDist = FULL, with_entropy: bool = False):
        with self.actor.module.disable_adapter():
            return self.actor.logprobs(batch, dist, with_entropy)

    def precision_stats(self) -> dict:
        return {"shares_actor_weights": 1.0}

    def take_token_counts(self) -> dict:
        return {}  # its passes run on the actor's engine and count as the actor's
