"""`verl-ds debug precision`: run N real steps of the configured job and measure, per active role,
what fp32, bf16 and fp16 would do to its numbers; then recommend one dtype per role.

Measured in the same run:
- ranges: weights (per tensor, `iter_full_params`), decoder-layer outputs and the output head
  (forward hooks), gradients at every optimizer step (a histogram of binary exponents of the
  nonzero elements, unscaled by the role's current loss scale, read through `Role.grad_partitions`
  just before `Role.step`), the reward model's scores and its within-group score differences;
- per dtype: the role's own output (logprobs, values, scores) recomputed on the last step's batch
  by a plain fp32 copy of the final weights cast to bf16/fp16 (the role's code, a plain module
  instead of the DeepSpeed engine), relative to fp32, and the actor's max |Δlogprob|;
- fp16 roles: the loss-scale trajectory and skipped steps (`precision/<role>/...` metrics).
Numbers are this rank's share (rank 0 prints and writes). Verdicts: `precision_report.py`.
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path

import torch

from verl_ds.algos import FP32LMHead
from verl_ds.config import load_config, read_ds_files
from verl_ds.diagnostics import precision_report as R
from verl_ds.diagnostics.memory import estimate_memory, load_shape, role_shapes
from verl_ds.diagnostics.observers import TrainerObserver
from verl_ds.diagnostics.precision_report import EXP_BINS, EXP_OFFSET
from verl_ds.dist import rank
from verl_ds.ds_config import render_ds_configs
from verl_ds.errors import ConfigError
from verl_ds.precision import (
    COMPUTE_DTYPES,
    POLICY_ROLES,
    TORCH_DTYPES,
    detect_hardware,
    json_dtypes,
    resolve_precision,
)
from verl_ds.programs.bench_precision import _finite
from verl_ds.roles import iter_full_params, load_causal_lm, load_reward_model
from verl_ds.roles.base import RoleObserver
from verl_ds.roles.batch import TrainBatch
from verl_ds.trainer.rl_trainer import RLTrainer


def exponent_hist(t: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, int]:
    """(histogram of frexp exponents e of the finite nonzero |t| / scale, non-finite count);
    |x| = m * 2**e with m in [0.5, 1), so |x| < 2**k exactly when e <= k."""
    a = t.detach().float().abs().reshape(-1)
    finite = torch.isfinite(a)
    nz = a[finite & (a > 0)] / scale
    e = torch.frexp(nz)[1].long().clamp(-EXP_OFFSET, EXP_BINS - EXP_OFFSET - 1) + EXP_OFFSET
    return torch.bincount(e.cpu(), minlength=EXP_BINS), int((~finite).sum())


def head_of(module: torch.nn.Module) -> torch.nn.Module:
    """The output layer: critic value head, reward score head, or the LM head."""
    for name in ("v_head", "score"):
        if isinstance(getattr(module, name, None), torch.nn.Module):
            return getattr(module, name)
    return module.get_output_embeddings()


class GroupIds(TrainerObserver):
    """Keeps the last training rollout's group ids."""

    def __init__(self, into: dict):
        self.into = into

    def on_rollout(self, trainer, rollout, scores):
        self.into["ids"] = rollout.batch.group_ids.clone()


class RoleProbe(RoleObserver):
    """Forward hooks and a `RoleObserver` on one live role; `close()` removes them all."""

    def __init__(self, name: str, role):
        self.name, self.role = name, role
        self.act_max, self.head_max, self.out = 0.0, 0.0, [math.inf, -math.inf]
        self.hist = torch.zeros(EXP_BINS, dtype=torch.long)
        self.nonfinite, self.grad_max, self.grad_tensor_max = 0, 0.0, []
        self.opt_steps, self.overflow_scales, self._aligned = 0, [], getattr(role, "aligned_skips", 0)
        self.call: tuple = ()  # the last scoring call's (batch, *args)
        self.train_batch = None  # the last mini-batch trained on (trainable roles)
        layers = [m for m in role.module.modules() if type(m).__name__.endswith(("DecoderLayer", "Block"))]
        self.handles = [m.register_forward_hook(self._on_layer) for m in layers]
        self.handles.append(head_of(role.module).register_forward_hook(self._on_head))
        role.observers.append(self)

    def on_score(self, role, batch, args, out):
        self.call = (batch, *args)
        if self.name == "reward":
            self.out = [min(self.out[0], float(out.min())), max(self.out[1], float(out.max()))]

    def on_accumulate(self, role, batch):
        self.train_batch = batch

    def on_step(self, role):
        self._on_step()

    @staticmethod
    def _first(out):
        return out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)

    def _on_layer(self, _m, _inp, out):
        self.act_max = max(self.act_max, float(self._first(out).detach().float().abs().max()))

    def _on_head(self, _m, _inp, out):
        o = self._first(out).detach().float()
        self.head_max = max(self.head_max, float(o.abs().max()))
        if self.name != "reward":
            self.out = [min(self.out[0], float(o.min())), max(self.out[1], float(o.max()))]

    def loss_scale(self) -> float:
        return float(self.role.precision_stats().get("loss_scale", 1.0)) if self.role.dtype == "fp16" else 1.0

    def _on_step(self):
        """Before the optimizer step: the reduced gradients, unscaled. Non-finite elements (an fp16
        overflow, or the inf a partner role's overflow planted: `aligned_skips`) are counted apart."""
        scale, self.opt_steps = self.loss_scale(), self.opt_steps + 1
        forced, self._aligned = self.role.aligned_skips > self._aligned, self.role.aligned_skips
        bad_here = 0
        for i, g in enumerate(self.role.grad_partitions()):
            h, bad = exponent_hist(g, scale)
            self.hist += h
            bad_here += bad
            a = g.detach().float().abs()
            a = a[torch.isfinite(a)]
            m = float(a.max()) / scale if a.numel() else 0.0
            if i >= len(self.grad_tensor_max):
                self.grad_tensor_max.append(0.0)
            self.grad_tensor_max[i] = max(self.grad_tensor_max[i], m)
            self.grad_max = max(self.grad_max, m)
        self.nonfinite += bad_here
        if bad_here and not forced:
            self.overflow_scales.append(scale)

    def close(self):
        for h in self.handles:
            h.remove()
        self.role.observers.remove(self)


class _PlainEngine:
    """Stands in for a role's DeepSpeed engine: a plain module on the role's device."""

    def __init__(self, module, device):
        self.module, self.device = module, device

    def __call__(self, *args, **kw):
        return self.module(*args, **kw)


def _skeleton(m: torch.nn.Module) -> torch.nn.Module:
    """A fresh, unwrapped fp32 module of the same architecture (ValueModel: backbone + head)."""
    if hasattr(m, "backbone") and hasattr(m, "v_head"):
        return type(m)(_skeleton(m.backbone), m.v_head.in_features)
    from transformers.initialization import no_init_weights

    with no_init_weights():
        skel = type(m)(copy.deepcopy(m.config))
    skel.tie_weights()  # as from_pretrained does (tied embeddings / lm_head)
    if hasattr(m, "get_output_embeddings") and m.get_output_embeddings() is not None:
        skel.get_output_embeddings().__class__ = type(m.get_output_embeddings())  # e.g. FP32LMHead
    return skel


def plain_fp32_copy(role, path: str | None = None) -> torch.nn.Module:
    """The role's current weights in a plain fp32 module (ZeRO-3 gathered one module at a time; a
    LoRA actor: its merged weights in the base architecture). `path`: an int8 role's checkpoint."""
    if getattr(role, "int8", False):  # quantized weights (reward model, teacher): the fp32 checkpoint instead
        if role.name == "reward":
            return load_reward_model(path).eval()
        return load_causal_lm(path, lm_head_fp32=isinstance(role.module.get_output_embeddings(), FP32LMHead)).eval()
    module = role.module.get_base_model() if hasattr(role.module, "peft_config") else role.module
    sd = {n: t.detach().float().cpu() for n, t in iter_full_params(role.engine)}
    sd.update({n: b.detach().cpu() for n, b in module.named_buffers()})
    skel = _skeleton(module).float()
    missing, _ = skel.load_state_dict(sd, strict=False)
    tied = {n for n, p in skel.named_parameters(remove_duplicate=False) if n not in dict(skel.named_parameters())}
    if set(missing) - tied:
        raise RuntimeError(f"{role.name}: weights missing from the gathered copy: {sorted(set(missing) - tied)[:5]}")
    return skel.eval()


def role_output(role, module: torch.nn.Module, call: tuple) -> torch.Tensor:
    """The role's own scoring code (logprobs/values/scores) run on `module` instead of its engine."""
    r = copy.copy(role)
    r.engine = _PlainEngine(module, role.device)
    fn = getattr(r, {"critic": "values", "reward": "score"}.get(role.name, "logprobs"))
    with torch.no_grad():
        return fn(*call).float().cpu()


def _rel(a: torch.Tensor, ref: torch.Tensor, mask) -> float:
    d, r = (a - ref), ref
    if mask is not None:
        d, r = d * mask, r * mask
    return float(d.norm() / r.norm().clamp_min(1e-12))


def vanish_fraction(scores: torch.Tensor, groups: torch.Tensor, dtype: str) -> tuple[float, int]:
    """Of the within-group score differences (pairs of samples of one prompt, nonzero in fp32), the
    fraction that rounding both scores to `dtype` erases (equal) or flips. Returns (fraction, pairs)."""
    i, j = torch.triu_indices(len(scores), len(scores), offset=1)
    same = groups[i] == groups[j]
    d32 = (scores[i] - scores[j])[same].double()
    q = scores.to(TORCH_DTYPES[dtype]).double()
    dq = (q[i] - q[j])[same]
    keep = d32 != 0
    lost = (dq[keep] == 0) | (torch.sign(dq[keep]) != torch.sign(d32[keep]))
    n = int(keep.sum())
    return (float(lost.float().mean()) if n else 0.0), n


def scoring_call(probe: RoleProbe, probes: dict, dist) -> tuple:
    """The role's last scoring call; a role that scored nothing this run (an on-policy actor) gets
    the batch another role scored, or the last mini-batch it trained on."""
    if probe.call:
        return probe.call
    others = [p.call[0] for p in probes.values() if p.call and p.name != "reward"]
    src = others[-1] if others else probe.train_batch
    data = TrainBatch(src.input_ids, src.attention_mask, src.loss_mask)  # the inputs only
    return (data, dist) if probe.name in POLICY_ROLES else (data,)


def measure_dtypes(probe: RoleProbe, call: tuple, groups, path: str | None = None) -> dict:
    """Weights, and the role's output under fp32/bf16/fp16 on the batch of `call` (`path`: an int8
    role's checkpoint)."""
    role = probe.role
    base = plain_fp32_copy(role, path)
    w_max = {n: float(p.detach().abs().max()) for n, p in base.named_parameters()}
    batch, *args = call
    mask = batch.loss_mask.float() if role.name != "reward" else None
    outs, secs = {}, {}
    for dt in ("fp32", "bf16", "fp16"):
        mod = copy.deepcopy(base).to(device=role.device, dtype=TORCH_DTYPES[dt])
        t0 = time.perf_counter()
        outs[dt] = role_output(role, mod, (batch, *args))
        secs[dt] = time.perf_counter() - t0
        del mod
    res = {
        "weight_max": max(w_max.values()),
        "weight_tensor_max": w_max,
        "rel_err": {dt: _rel(o, outs["fp32"], mask) for dt, o in outs.items()},
        "fwd_s": secs,
    }
    if role.name in POLICY_ROLES:
        res["logprob_gap"] = {dt: float(((o - outs["fp32"]).abs() * mask).max()) for dt, o in outs.items()}
    if role.name == "reward" and groups is not None:
        res["vanish"] = {dt: vanish_fraction(outs["fp32"], groups, dt)[0] for dt in ("bf16", "fp16")}
        res["pairs"] = vanish_fraction(outs["fp32"], groups, "bf16")[1]
    return res


def weight_memory(cfg, role: str, shape, world: int, hw, shapes: dict | None = None) -> dict[str, float]:
    """Weight bytes of `role` per dtype from the analytic model (what `debug memory` prints);
    `shapes`: the roles with a model of their own (`role_shapes`)."""
    out = {}
    for dt in COMPUTE_DTYPES:
        c = copy.deepcopy(cfg)
        setattr(c.precision, f"{role}_dtype", dt)
        p = resolve_precision(c.precision, hw, json_dtypes(read_ds_files(c)), log_choice=False)
        est = estimate_memory(c, shape, render_ds_configs(c, world, p), world, p.rollout, role_shapes=shapes)
        out[dt] = sum(v for k, v in est["update"][role].items() if k.startswith("weights_"))
    return out


def debug_precision(
    config_path: str | None,
    overrides: list[str],
    steps: int,
    out_dir: str | Path | None,
    trainer_cls: type[RLTrainer] = RLTrainer,
) -> dict:
    """(One program read top to bottom (measure, render, report); its parts are calls, the length is their sequence.)
    Run `steps` steps with every role probed; print-ready report, `precision.yaml` in `out_dir`.
    `trainer_cls`: a subclass of `RLTrainer` (a test plants a fault in one role's loss)."""
    if steps <= 0:
        raise ConfigError("--steps", f"must be > 0, got {steps}")
    t0 = time.perf_counter()
    user = load_config(config_path, overrides)
    out = Path(out_dir or Path(user.trainer.run_dir) / "debug_precision")
    cfg = load_config(
        config_path,
        list(overrides)
        + ["logging.wandb.mode=disabled", "trainer.resume=none", f"trainer.steps={steps}", f"trainer.run_dir={out}"],
    )
    rows, groups = [], {}
    with trainer_cls(cfg) as trainer:
        # a role without its own engine (a LoRA actor's adapters-off reference) is the actor's numbers
        probes = {name: RoleProbe(name, role) for name, role in trainer.roles.items() if hasattr(role, "engine")}
        watch = GroupIds(groups)  # the rollout's group ids, for the reward model's score differences
        trainer.observers.append(watch)
        try:
            for _ in range(steps):
                rows.append(trainer.step())
        finally:
            trainer.observers.remove(watch)
            for p in probes.values():
                p.close()
        roles = {}
        for name, p in probes.items():
            roles[name] = {
                "dtype": trainer.precision.role(name),
                "trainable": p.role.trainable,
                "act_max": p.act_max,
                "head_max": p.head_max,
                "out_range": p.out,
                **measure_dtypes(
                    p,
                    scoring_call(p, probes, trainer.setup.sampled),
                    groups.get("ids"),
                    {"reward": cfg.model.reward_path, "teacher": cfg.model.teacher_path}.get(name),
                ),
            }
            if p.role.trainable:
                ls = getattr(trainer.precision, f"{name}_loss_scaling")
                roles[name].update(
                    grad_hist=p.hist.tolist(),
                    grad_nonfinite=p.nonfinite,
                    grad_max=p.grad_max,
                    grad_tensor_max=p.grad_tensor_max,
                    init_scale_power=ls.initial_scale_power,
                    opt_steps=p.opt_steps,
                    overflow_scales=p.overflow_scales,
                    loss_scale=[r.get(f"precision/{name}/loss_scale", 1.0) for r in rows],
                    skipped_steps=rows[-1].get(f"precision/{name}/skipped_steps", 0.0),
                    aligned_skips=rows[-1].get(f"precision/{name}/aligned_skips", 0.0),
                )
        world, model_path = trainer.world, trainer.model_path
        notes = [
            f"{n}: runs on the actor's engine (LoRA adapters off): no numbers of its own"
            for n in trainer.roles
            if n not in probes
        ]
    hw = detect_hardware(cfg.trainer.device)
    shape = load_shape(str(Path(model_path) / "config.json"))
    shapes = role_shapes(cfg)
    mem = {name: weight_memory(cfg, name, shape, world, hw, shapes) for name in roles}
    result = R.build_report(roles, rows, mem, world, hw, steps, time.perf_counter() - t0, notes)
    if rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "precision.yaml").write_text(result["yaml"])
        (out / "debug_precision.md").write_text(result["report"] + "\n")
        (out / "debug_precision.json").write_text(json.dumps(_finite({"steps": steps, "roles": roles}), indent=1))
        result["report"] += (
            f"\nwrote {out / 'precision.yaml'} (paste into the run config), debug_precision.md "
            "and .json (per-tensor maxima)"
        )
    return {**result, "roles": roles, "out_dir": str(out)}
