"""Supervised fine-tuning on DeepSpeed with the precision knobs users know from other trainers:

    Trainer(model, strategy="zero2", precision="fp16", grad_scaler=True, max_grad_norm=1.0).fit(data)

`strategy` picks the ZeRO stage, `precision` the compute dtype (fp32 master weights for 16-bit),
`grad_scaler=True` with fp16 means DeepSpeed's dynamic loss scaling, `cpu_gemm` is the RL config's
`precision.cpu_gemm` (16-bit GEMMs as fp32 products on a CPU without 16-bit kernels). Backward and
step go through the engine (a `Role`), so overflows, skipped steps and loss scale are DeepSpeed's own.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from verl_ds.ds_config import precision_blocks
from verl_ds.errors import ConfigError
from verl_ds.gemm import fp32_gemm
from verl_ds.precision import (
    CPU_GEMM_MODES,
    LossScaling,
    PrecisionConfig,
    detect_hardware,
    fp32_gemm_dtypes,
    resolve_precision,
)
from verl_ds.roles.base import Role
from verl_ds.roles.params import export_hf

log = logging.getLogger(__name__)
STRATEGIES = {"ddp": 0, "zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def sft_ds_config(
    strategy: str,
    precision: str,
    grad_scaler,
    max_grad_norm: float,
    lr: float,
    weight_decay: float,
    micro_batch_size: int,
    batch_size: int,
    world_size: int,
    with_optimizer: bool,
) -> dict:
    if strategy == "fsdp":
        raise ConfigError(
            "strategy",
            "'fsdp' is not a DeepSpeed strategy: use 'zero3' (like FSDP FULL_SHARD) or 'zero2' (like SHARD_GRAD_OP)",
        )
    if strategy not in STRATEGIES:
        raise ConfigError("strategy", f"'{strategy}' is not one of {', '.join(STRATEGIES)}")
    if precision not in ("fp32", "fp16", "bf16"):
        raise ConfigError("precision", f"'{precision}' is not one of fp32, fp16, bf16, auto")
    if grad_scaler and precision != "fp16":
        raise ConfigError(
            "grad_scaler",
            f"loss scaling is for fp16 only: {precision} has fp32's exponent range, "
            "so gradients do not underflow; drop grad_scaler",
        )
    scaling = LossScaling() if grad_scaler in (None, True) else LossScaling(loss_scale=1.0)  # False: static 1
    if batch_size % (micro_batch_size * world_size):
        raise ConfigError(
            "batch_size", f"{batch_size} is not divisible by micro_batch_size {micro_batch_size} x {world_size} ranks"
        )
    ds = {
        "train_batch_size": batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": batch_size // (micro_batch_size * world_size),
        "gradient_clipping": max_grad_norm,
        "zero_optimization": {"stage": STRATEGIES[strategy]},
        "steps_per_print": 10**9,
        **precision_blocks(precision, scaling),
    }
    if with_optimizer:
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": lr, "weight_decay": weight_decay, "torch_adam": True, "fused": True},
        }
    return ds


class Trainer:
    """SFT with a causal-LM loss on completion tokens only. `model` is an HF model or a path."""

    def __init__(
        self,
        model,
        optimizer=None,
        strategy: str = "zero2",
        precision: str = "auto",
        grad_scaler: bool | None = None,
        max_grad_norm: float = 1.0,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        micro_batch_size: int = 8,
        batch_size: int | None = None,
        tokenizer=None,
        trust_remote_code: bool = False,
        cpu_gemm: str = "auto",
    ):
        from verl_ds.dist import init_distributed, world_size
        from verl_ds.roles.policy import load_causal_lm

        init_distributed()
        if cpu_gemm not in CPU_GEMM_MODES:
            raise ConfigError("cpu_gemm", f"'{cpu_gemm}' is not one of {', '.join(CPU_GEMM_MODES)}")
        hw = detect_hardware()
        if precision == "auto":  # the same rule as the RL roles, resolved in one place
            precision = resolve_precision(PrecisionConfig(actor_dtype="auto"), hw).actor
        if isinstance(model, (str, Path)):
            from verl_ds.data.tiny import load_tokenizer

            tokenizer = tokenizer or load_tokenizer(model, trust_remote_code)
            model = load_causal_lm(str(model), trust_remote_code)
        self.tokenizer = tokenizer
        batch_size = batch_size or micro_batch_size * world_size()
        ds = sft_ds_config(
            strategy,
            precision,
            grad_scaler,
            max_grad_norm,
            lr,
            weight_decay,
            micro_batch_size,
            batch_size,
            world_size(),
            with_optimizer=optimizer is None,
        )
        self.role = Role("sft", model, ds, trainable=True, optimizer=optimizer)
        self.precision, self.batch_size = precision, batch_size
        self.fp32_gemm = fp32_gemm_dtypes(cpu_gemm, hw, {precision})  # the RL trainer's rule
        self.losses: list[float] = []

    @property
    def engine(self):
        return self.role.engine

    def compute_loss(self, batch: dict) -> torch.Tensor:
        """Mean token cross-entropy over positions whose label is not -100 (override to customise)."""
        out = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        logits = out.logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
        )

    def collate(self, rows: list[dict]) -> dict:
        """Rows are {prompt, completion|answer} texts (loss on the completion + eos) or token dicts."""
        seqs, labels = [], []
        for r in rows:
            if "input_ids" in r:
                ids, lab = list(r["input_ids"]), list(r.get("labels", r["input_ids"]))
            else:
                p = self.tokenizer(r["prompt"])["input_ids"]
                c = self.tokenizer(str(r.get("completion", r.get("answer"))), add_special_tokens=False)["input_ids"]
                c = c + [self.tokenizer.eos_token_id]
                ids, lab = p + c, [-100] * len(p) + c
            seqs.append(ids)
            labels.append(lab)
        n = max(map(len, seqs))
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else 0
        batch = {
            "input_ids": torch.tensor([s + [pad] * (n - len(s)) for s in seqs]),
            "attention_mask": torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs]),
            "labels": torch.tensor([lab + [-100] * (n - len(lab)) for lab in labels]),
        }
        return {k: v.to(self.role.device) for k, v in batch.items()}

    def fit(self, dataset, epochs: int = 1, max_steps: int | None = None, seed: int = 0) -> list[float]:
        """Train; returns the loss of every optimizer step (each rank takes its share of each batch)."""
        with fp32_gemm(self.fp32_gemm):
            return self._fit(dataset, epochs, max_steps, seed)

    def _fit(self, dataset, epochs: int, max_steps: int | None, seed: int) -> list[float]:
        from verl_ds.dist import rank, world_size

        g = torch.Generator().manual_seed(seed)
        micro = self.role.micro_batch_size
        gas = self.engine.gradient_accumulation_steps()
        steps = 0
        for _ in range(epochs):
            order = torch.randperm(len(dataset), generator=g).tolist()
            for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
                mine = order[start : start + self.batch_size][rank() :: world_size()]
                total = 0.0
                for i in range(gas):
                    loss = self.compute_loss(self.collate([dataset[j] for j in mine[i * micro : (i + 1) * micro]]))
                    self.role.backward(loss, boundary=i == gas - 1)  # through the role: its gradient reduction
                    total += loss.item() / gas
                self.role.step()
                self.losses.append(total)
                steps += 1
                if max_steps and steps >= max_steps:
                    return self.losses
        return self.losses

    @property
    def skipped_steps(self) -> int:
        return int(self.engine.skipped_steps)

    def precision_stats(self) -> dict:
        return self.role.precision_stats()

    def save(self, out_dir: str | Path, dtype: str | None = None) -> Path:
        """Export an HF model (safetensors) atomically; all ranks must call it (ZeRO-3 gathers)."""
        return export_hf(self.engine, out_dir, dtype or self.precision, self.tokenizer)
