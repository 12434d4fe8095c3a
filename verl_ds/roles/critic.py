"""Critic: a causal-LM backbone plus a scalar value head, trained with the clipped value loss."""

from __future__ import annotations

import torch

from verl_ds import algos
from verl_ds.config import AlgorithmConfig
from verl_ds.roles import attention
from verl_ds.roles.base import Role, enable_grad_checkpointing, pad_response, trim_padding
from verl_ds.roles.batch import TrainBatch


class ValueModel(torch.nn.Module):
    """`backbone` (an HF base model) -> hidden states -> Linear(hidden, 1). The head starts at zero,
    so initial values are 0 and early advantages are the plain returns."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.v_head = torch.nn.Linear(hidden_size, 1, bias=True)
        torch.nn.init.zeros_(self.v_head.weight)
        torch.nn.init.zeros_(self.v_head.bias)

    def forward(self, input_ids, attention_mask, position_ids):
        h = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.v_head(h).squeeze(-1)


def load_value_model(
    path: str, trust_remote_code: bool = False, grad_checkpointing: bool = False, attn_implementation: str = "sdpa"
) -> ValueModel:
    """The backbone of the causal LM at `path` (the actor's, unless a critic path is given), with the policy
    models' attention (under sequence parallelism, the one DeepSpeed's wrapper replaces)."""
    from transformers import AutoModel

    if attn_implementation == attention.NAME:
        attention.register()
    backbone = AutoModel.from_pretrained(
        path, dtype=torch.float32, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
    )
    if grad_checkpointing:
        enable_grad_checkpointing(backbone)
    return ValueModel(backbone, backbone.config.hidden_size)


class Critic(Role):
    """Reads vf_clip, vf_coef, loss_agg_mode from `loss_cfg`."""

    def __init__(self, model: ValueModel, ds_config: dict, loss_cfg: AlgorithmConfig, sp=None):
        super().__init__("critic", model, ds_config, trainable=True, sp=sp)
        self.cfg = loss_cfg

    def forward(self, batch: TrainBatch) -> torch.Tensor:
        if self.sp:  # each row split along the sequence (`roles/sequence_parallel.py`)
            return self.sp.values(self.engine, batch, self.prefix_pack(batch))
        pack = self.prefix_pack(batch)
        if pack is not None:  # each shared prefix once (`prefix.py`)
            keep, where = pack.response(batch.response_width)
            values = self.engine(**pack.inputs(self.prefix_mask(pack)))[0, keep].float()
            return values.new_zeros(where.shape).masked_scatter(where, values)
        inputs, resp_len = trim_padding(batch)  # only the columns some row uses
        values = self.engine(**inputs)
        # V(state before each response token)
        return pad_response(values[:, -resp_len - 1 : -1].float(), batch.response_width)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        out = self.map_micro(batch, self.forward)
        self.notify("on_score", batch, (), out)
        return out

    global_metric_keys = ("vf_loss",)

    def micro_loss(self, mb: TrainBatch, counts: dict):
        c = self.cfg
        mb.require("old_values", "returns", needed_by="the critic's loss")
        vf_loss, m = algos.value_loss(
            self.forward(mb),
            mb.old_values,
            mb.returns,
            mb.loss_mask,
            clip=c.vf_clip,
            agg_mode=c.loss_agg_mode,
            **counts,
        )
        return c.vf_coef * vf_loss, {"vf_loss": vf_loss, **m}, None
