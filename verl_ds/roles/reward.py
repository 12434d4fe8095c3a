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
    else the builder's SDPA (a shared prefix's mask is SDPA's), or transformers' default (None)."""
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

    _FIRST_RESPONSE = False  # a row's real tokens only: HF pools at its last one

    def _shared_scores(self, mb: TrainBatch, pack, pad: int) -> torch.Tensor:
        """`[b]` scores of a shared-prefix pack: the backbone once, the score head at each row's last
        token that is not the reward model's `pad` id (where HF's sequence classifier pools)."""
        model = self.module
        backbone = getattr(model, model.base_model_prefix)
        hidden = backbone(**pack.inputs(self.prefix_mask(pack)), use_cache=False).last_hidden_state[0]
        held = pack.index >= 0
        real = held & (mb.input_ids != pad)
        cols = torch.arange(held.shape[1], device=held.device).expand_as(held)
        last = torch.where(real, cols, -1).amax(1)  # HF: the last non-pad token, else the first column held
        last = torch.where(last >= 0, last, torch.where(held, cols, held.shape[1]).amin(1))
        return model.score(hidden[pack.index.gather(1, last[:, None])[:, 0]])[:, 0].float()

    @torch.no_grad()
    def score(self, batch: TrainBatch) -> torch.Tensor:
        """One fp32 score per sequence `[B]`, read at the last non-pad token (HF's pooling)."""
        pad = self.module.config.pad_token_id

        def scores(mb: TrainBatch) -> torch.Tensor:
            pack = self.prefix_pack(mb)
            if pack is not None:  # each shared prefix once (`prefix.py`), the head where HF pools
                return self._shared_scores(mb, pack, pad)
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
