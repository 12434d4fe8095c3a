"""Reward model role: an HF sequence classifier (num_labels=1), optionally with int8 weights."""

from __future__ import annotations

import logging

import torch

from verl_ds.errors import ConfigError
from verl_ds.precision import TORCH_DTYPES
from verl_ds.roles.base import Role, model_inputs
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


def quantize_int8(model: torch.nn.Module, activation_dtype: str) -> torch.nn.Module:
    """Linear weights -> int8. CPU: torch.ao dynamic quantization (int8 weights, activations quantized
    per batch; the rest of the model stays fp32). CUDA: torchao int8 weight-only, activations in
    `activation_dtype`."""
    if torch.cuda.is_available():
        try:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
        except ImportError:
            raise ConfigError("precision.reward_dtype", "int8 on GPU needs torchao (pip install torchao)") from None
        model = model.to(device="cuda", dtype=TORCH_DTYPES.get(activation_dtype, torch.bfloat16))
        quantize_(model, Int8WeightOnlyConfig())
        return model
    if activation_dtype != "fp32":
        log.warning("int8 reward on CPU: dynamic quantization runs fp32 activations, not %s", activation_dtype)
    return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def load_reward_model(path: str, dtype: str, activation_dtype: str, trust_remote_code: bool = False):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    if dtype == "int8":
        before = tensor_bytes(model)
        model = quantize_int8(model.eval(), activation_dtype)
        after = tensor_bytes(model)
        log.info(
            "int8 reward model: %.2f MB -> %.2f MB (%.1f%% saved)",
            before / 2**20,
            after / 2**20,
            100 * (1 - after / before),
        )
    return model


class RewardModel(Role):
    def __init__(self, model, ds_config: dict, int8: bool = False):
        super().__init__("reward", model, ds_config, trainable=False)
        self.int8 = int8

    def precision_stats(self) -> dict:
        stats = super().precision_stats()
        if self.int8:
            stats["param_dtype"] = "int8"
        stats["weight_bytes"] = float(tensor_bytes(self.module))
        return stats

    @torch.no_grad()
    def score(self, batch: dict) -> torch.Tensor:
        """One fp32 score per sequence `[B]`, read at the last non-pad token (HF's pooling)."""
        pad = self.module.config.pad_token_id

        def scores(mb: dict) -> torch.Tensor:
            # HF pools at the last non-pad token: mark padding with the reward model's own pad id
            # (the policy's may differ), so the score is read at the last real token.
            ids = torch.where(mb["attention_mask"].bool(), mb["input_ids"], pad)
            return self.engine(**model_inputs({**mb, "input_ids": ids})).logits.squeeze(-1).float()

        out = self.map_micro(batch, scores)
        self.notify("on_score", batch, (), out)
        return out
