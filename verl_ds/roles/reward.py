"""Reward model role: an HF sequence classifier (num_labels=1), optionally with int8 weights (`Role`)."""

from __future__ import annotations

import torch

from verl_ds.roles import attention
from verl_ds.roles.base import Role, trim_padding
from verl_ds.roles.batch import TrainBatch
from verl_ds.roles.quant import tensor_bytes


def load_reward_model(path: str, trust_remote_code: bool = False, attn_implementation: str | None = None):
    """The fp32 checkpoint as a scorer; the role casts it (DeepSpeed's dtype, or int8 weights). Under
    sequence parallelism it takes the policy models' attention (the one DeepSpeed's wrapper replaces);
    else transformers' default."""
    from transformers import AutoModelForSequenceClassification

    if attn_implementation == attention.NAME:
        attention.register()
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32, trust_remote_code=trust_remote_code, **kw
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model


class RewardModel(Role):
    def __init__(self, model, ds_config: dict, int8_activation: str | None = None, sp=None):
        super().__init__("reward", model, ds_config, trainable=False, int8_activation=int8_activation, sp=sp)

    def precision_stats(self) -> dict:
        stats = super().precision_stats()
        stats["weight_bytes"] = float(tensor_bytes(self.module))
        return stats

    @torch.no_grad()
    def score(self, batch: TrainBatch) -> torch.Tensor:
        """One fp32 score per sequence `[B]`, read at the last non-pad token (HF's pooling)."""
        pad = self.module.config.pad_token_id

        def scores(mb: TrainBatch) -> torch.Tensor:
            # HF pools at the last non-pad token: mark padding with the reward model's own pad id
            # (the policy's may differ), so the score is read at the last real token.
            inputs, _ = trim_padding(mb)  # only the columns some row uses (a token budget counts those)
            inputs["input_ids"] = torch.where(inputs["attention_mask"].bool(), inputs["input_ids"], pad)
            return self.engine(**inputs).logits.squeeze(-1).float()

        if self.sp:  # each row split along the sequence (`roles/sequence_parallel.py`)
            out = self.sp.scores(self.module, batch, pad)
        else:
            out = self.map_micro(batch, scores)
        self.notify("on_score", batch, (), out)
        return out
