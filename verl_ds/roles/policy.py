"""Actor (trained), reference and teacher (frozen): causal LMs that score response tokens."""

from __future__ import annotations

import torch

from verl_ds import algos
from verl_ds.config import AlgorithmConfig
from verl_ds.roles import attention, prefix
from verl_ds.roles.base import Role, enable_grad_checkpointing, pad_response, trim_padding
from verl_ds.roles.batch import TrainBatch


def load_causal_lm(
    path: str,
    trust_remote_code: bool = False,
    grad_checkpointing: bool = False,
    lm_head_fp32: bool = False,
    attn_implementation: str = "sdpa",
):
    from transformers import AutoModelForCausalLM

    if attn_implementation == attention.NAME:
        attention.register()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
    )
    if lm_head_fp32:
        algos.use_fp32_lm_head(model)
    _contiguous_head_input(model)
    if grad_checkpointing:
        enable_grad_checkpointing(model)
    return model


def _contiguous_head_input(model) -> None:
    """`logits_to_keep` hands the LM head a strided slice of the hidden states. With a frozen head
    (the reference, a LoRA actor) torch.matmul cannot fold that into one mm and expands the [V, H]
    weight per sequence instead, several times slower than one small copy to a contiguous
    [B, R+1, H] input."""
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(lambda _m, args: (args[0].contiguous(), *args[1:]))


def pack_rows(batch: TrainBatch) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Padding-free inputs for one micro-batch: every row's real tokens in one `[1, N]` sequence, the
    rows in order, positions restarting at 0 in each (transformers reads a restart as a new sequence:
    flash-attention's varlen kernels, or a block-diagonal mask for SDPA and eager, keep attention
    inside each row; `use_cache=False`, else it keeps the plain causal mask). Returns (model inputs,
    the pack positions whose logits predict response tokens `[K]`, where those tokens sit in the
    response `[B, R]` bool). A row's first response column always runs, so an empty
    response still has a (masked) token to score and the pass is never empty."""
    mask = batch.attention_mask.bool()
    p = mask.shape[1] - batch.response_width
    take = mask.clone()
    take[:, p] = True
    order = take.flatten().long().cumsum(0).view_as(take) - 1  # each taken token's place in the pack
    pos = take.long().cumsum(1) - 1  # counts real tokens, as `model_inputs` does for padded rows
    resp = take[:, p:]
    inputs = {"input_ids": batch.input_ids[take][None], "position_ids": pos[take][None]}
    return inputs, order[:, p:][resp] - 1, resp


class PolicyRole(Role):
    """Log-probabilities of the response tokens: batch tensors are `[B, P + R]` with the response
    in the last R positions; outputs are fp32 `[B, R]`, under the `algos.TokenDist` the rollout
    sampled them from (its temperature, and the top-k/top-p set renormalised)."""

    def forward(self, batch: TrainBatch, dist: algos.TokenDist = algos.FULL, with_entropy: bool = False):
        if self.sp:  # each row split along the sequence (`roles/sequence_parallel.py`)
            pack = self.prefix_pack(batch)  # a micro-batch of several rows: one pack
            return self.sp.policy_forward(self.engine, batch, dist, with_entropy, self._entropy_needs_grad, pack)
        pack = self.prefix_pack(batch)
        if pack is not None:
            logits, labels, to_rows = self._shared_logits(batch, pack)
        elif self.packing:
            logits, labels, to_rows = self._packed_logits(batch)
        else:
            logits, labels, to_rows = self._padded_logits(batch)
        logprob, entropy = algos.token_logprobs(logits, labels, dist, with_entropy, self._entropy_needs_grad)
        return to_rows(logprob), None if entropy is None else to_rows(entropy)

    def _padded_logits(self, batch: TrainBatch):
        """(logits `[B, r, V]`, the response tokens `[B, r]`, back to the batch's `[B, R]`) over the
        columns some row uses (`trim_padding`)."""
        width = batch.response_width
        inputs, resp_len = trim_padding(batch)
        # only the R positions that predict response tokens: no [B, P, V] logits for the prompt,
        # and contiguous ones (a [:, :-1] slice would be copied by every pass over the logits)
        width_in = inputs["input_ids"].shape[1]
        keep = torch.arange(width_in - resp_len - 1, width_in - 1, device=inputs["input_ids"].device)
        logits = self.engine(**inputs, use_cache=False, logits_to_keep=keep).logits
        return logits, inputs["input_ids"][:, -resp_len:], lambda x: pad_response(x, width)

    def _packed_logits(self, batch: TrainBatch):
        """(logits `[1, K, V]`, the response tokens `[1, K]`, back to `[B, R]`) over `pack_rows`: one
        sequence, logits only where they predict a response token."""
        inputs, keep, where = pack_rows(batch)
        logits = self.engine(**inputs, use_cache=False, logits_to_keep=keep).logits
        labels = batch.input_ids[:, -batch.response_width :][where][None]
        return logits, labels, lambda x: x.new_zeros(where.shape).masked_scatter(where, x[0])

    def _shared_logits(self, batch: TrainBatch, pack: prefix.PrefixPack):
        """(logits `[1, K, V]`, the response tokens `[1, K]`, back to `[B, R]`) over a shared-prefix pack
        (`prefix.py`): each shared prefix once, logits only where they predict a response token."""
        keep, where = pack.response(batch.response_width)
        logits = self.engine(**pack.inputs(self.prefix_mask(pack)), use_cache=False, logits_to_keep=keep).logits
        labels = batch.input_ids[:, -batch.response_width :][where][None]
        return logits, labels, lambda x: x.new_zeros(where.shape).masked_scatter(where, x[0])

    _entropy_needs_grad = False  # only an entropy bonus needs its gradient

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, dist: algos.TokenDist = algos.FULL, with_entropy: bool = False):
        """Micro-batched, no grad. Returns logprob `[B, R]` (and entropy `[B, R]` if asked)."""
        logprob, entropy = self.map_micro(batch, lambda mb: self.forward(mb, dist, with_entropy))
        out = (logprob, entropy) if with_entropy else logprob
        self.notify("on_score", batch, (dist,), out)
        return out


class Reference(PolicyRole):
    def __init__(self, model, ds_config: dict, sp=None):
        super().__init__("reference", model, ds_config, trainable=False, sp=sp)


class Teacher(PolicyRole):
    """Scores the student's samples for on-policy distillation (`logprobs`, as the reference)."""

    def __init__(self, model, ds_config: dict, int8_activation: str | None = None, sp=None):
        super().__init__("teacher", model, ds_config, trainable=False, int8_activation=int8_activation, sp=sp)


class Actor(PolicyRole):
    """Trains with the clipped PPO surrogate from `verl_ds.algos`, plus optional KL and entropy terms.

    Reads from `loss_cfg`: clip_low, clip_high, dual_clip_c, loss_agg_mode, entropy_coef,
    use_kl_loss, kl_coef, kl_estimator, tis_cap, tis_mode, policy_loss (vanilla | gspo | cispo), distill
    (its loss mode: a reverse-KL term to the teacher).
    """

    def __init__(self, model, ds_config: dict, loss_cfg: AlgorithmConfig, dist: algos.TokenDist = algos.FULL, sp=None):
        super().__init__("actor", model, ds_config, trainable=True, sp=sp)
        self.cfg, self.dist = loss_cfg, dist
        self._entropy_needs_grad = bool(loss_cfg.entropy_coef)
        self.policy_loss = algos.get_policy_loss(loss_cfg.policy_loss)
        # a run with kl_coef > 0 has a reference (`config.active_roles`); use_kl_loss puts its KL here
        self.kl_loss = loss_cfg.use_kl_loss and loss_cfg.kl_coef > 0
        self.distill_loss = bool(loss_cfg.distill.coef) and loss_cfg.distill.mode == "loss"
        # what this loss reads besides the inputs, decided here once (`TrainBatch.require`)
        self.needs = ("advantages",)
        self.needs += ("ref_logprobs",) * self.kl_loss + ("teacher_logprobs",) * self.distill_loss
        self.needs += ("rollout_logprobs",) * bool(loss_cfg.tis_cap)

    global_metric_keys = ("pg_loss", "entropy", "kl_loss", "distill_loss")

    def micro_loss(self, mb: TrainBatch, counts: dict):
        """Clipped surrogate (+ entropy bonus, + KL to the reference or the teacher as loss terms)."""
        c, mask = self.cfg, mb.loss_mask
        mb.require(*self.needs, *(() if mb.on_policy else ("old_logprobs",)), needed_by="the actor's loss")
        logprob, entropy = self.forward(mb, self.dist, with_entropy=True)
        # on-policy (one mini-batch, first epoch): the old policy is this very forward (ratio 1, exact)
        old = logprob.detach() if mb.on_policy else mb.old_logprobs
        is_w = algos.tis_weights(old, mb.rollout_logprobs, mask, cap=c.tis_cap, mode=c.tis_mode) if c.tis_cap else None
        pg_loss, m = self.policy_loss(
            old,
            logprob,
            mb.advantages,
            mask,
            clip_low=c.clip_low,
            clip_high=c.clip_high,
            dual_clip_c=c.dual_clip_c,
            agg_mode=c.loss_agg_mode,
            is_weights=is_w,
            **counts,
        )
        loss = pg_loss
        ent = algos.agg_loss(entropy, mask, c.loss_agg_mode, **counts)
        if c.entropy_coef:
            loss = loss - c.entropy_coef * ent
        if self.kl_loss:
            kl = algos.agg_loss(
                algos.kl_penalty(logprob, mb.ref_logprobs, c.kl_estimator), mask, c.loss_agg_mode, **counts
            )
            loss = loss + c.kl_coef * kl
            m["kl_loss"] = kl
        d = c.distill
        if self.distill_loss:  # reverse KL to the teacher
            dl = algos.agg_loss(
                algos.kl_penalty(logprob, mb.teacher_logprobs, d.kl_estimator), mask, c.loss_agg_mode, **counts
            )
            loss = loss + d.coef * dl
            m["distill_loss"] = dl
        return loss, {"pg_loss": pg_loss, "entropy": ent, **m}, logprob.detach()
