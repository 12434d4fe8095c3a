"""Markdown tables and the `verl-ds debug memory` report."""

from __future__ import annotations

import math
from dataclasses import replace

from verl_ds.config import read_json_object
from verl_ds.diagnostics.memory.estimate import (
    BYTES,
    COMPONENTS,
    GIB,
    GPU_OVERHEAD_GIB,
    MIB,
    STAGE_GROUPS,
    STAGES,
    ModelShape,
    estimate_memory,
    host_memory,
    rollout_memory,
    stage_totals,
    verdict,
    workload,
)
from verl_ds.ds_config import render_ds_configs, run_precision
from verl_ds.errors import ConfigError
from verl_ds.rollout.engines.distributed import choose_engine


def fmt_bytes(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    for unit, div in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _components(*dicts) -> list[str]:
    keys = {k for d in dicts for k in d}
    order = {c: i for i, c in enumerate(COMPONENTS)}
    return sorted(keys, key=lambda k: (order.get("weights" if k.startswith("weights") else k, 99), k))


def memory_table(est: dict, measured: dict | None, stages=STAGES) -> str:
    """One Markdown table per stage: role | component | estimate | measured."""
    out = []
    for s in stages:
        e_roles, m_roles = est.get(s, {}), (measured or {}).get(s, {})
        rows = []
        for role in list(e_roles) + [r for r in m_roles if r not in e_roles]:
            e, m = e_roles.get(role, {}), m_roles.get(role, {})
            for c in _components(e, m):
                rows.append([role, c, fmt_bytes(e.get(c)), fmt_bytes(m.get(c)) if measured else "n/a"])
            if role != "process":
                rows.append([role, "**total**", fmt_bytes(sum(e.values())), fmt_bytes(sum(m.values())) if m else "n/a"])
        rows.append(
            [
                "**all roles**",
                "**total**",
                fmt_bytes(stage_totals({s: e_roles})[s]),
                fmt_bytes(sum(sum(c.values()) for r, c in m_roles.items() if r != "process")) if m_roles else "n/a",
            ]
        )
        out.append(f"### stage: {s}\n\n" + md_table(["role", "component", "estimate", "measured"], rows))
    return "\n\n".join(out)


def _merge_weights(comp: dict) -> tuple[dict, str]:
    """`weights_<dtype>` entries -> one `weights` entry, and the dtype label."""
    dts = [k[len("weights_") :] for k in comp if k.startswith("weights_")]
    out = {k: v for k, v in comp.items() if not k.startswith("weights_")}
    if dts:
        out["weights"] = sum(comp[f"weights_{d}"] for d in dts)
    return out, "+".join(dts)


def compare_table(a: dict, b: dict, names=("a", "b")) -> str:
    """Per role and component: a | b | delta (b - a) | ratio (b / a). Inputs: {role: {component: bytes}}."""
    rows = []
    for role in list(a) + [r for r in b if r not in a]:
        (ra, da), (rb, db) = _merge_weights(a.get(role, {})), _merge_weights(b.get(role, {}))
        for c in _components(ra, rb) + ["total"]:
            va = sum(ra.values()) if c == "total" else ra.get(c, 0.0)
            vb = sum(rb.values()) if c == "total" else rb.get(c, 0.0)
            ratio = f"{vb / va:.2f}" if va else "n/a"
            label = f"weights ({da} → {db})" if c == "weights" and da != db else c
            rows.append(
                [role, label, fmt_bytes(va), fmt_bytes(vb), ("+" if vb >= va else "-") + fmt_bytes(abs(vb - va)), ratio]
            )
    return md_table(["role", "component", names[0], names[1], "delta", "ratio"], rows)


# ============================================================== report (used by `verl-ds debug memory`)


def load_shape(config_json: str) -> ModelShape:
    from pathlib import Path

    p = Path(config_json)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError("--model-config", f"HF config.json not found: {p}")
    try:
        return ModelShape.from_hf_config(read_json_object(p, "an HF config.json"))
    except (KeyError, TypeError) as e:
        raise ConfigError(str(p), f"not a decoder config.json this estimate understands ({e})") from None


def role_shapes(cfg) -> dict[str, ModelShape]:
    """The shapes of the roles with a model of their own (reward model, teacher) whose config.json
    is here; the others are estimated with the policy's shape."""
    from pathlib import Path

    paths = {"reward": cfg.model.reward_path, "teacher": cfg.model.teacher_path}
    return {r: load_shape(p) for r, p in paths.items() if p and (Path(p) / "config.json").is_file()}


def report(
    cfg, shape: ModelShape, world: int, stage: str = "all", measured: dict | None = None, gpu_gib: float | None = None
) -> str:
    """The Markdown `debug memory` prints: a header, one table per stage, and the verdict."""

    precision = run_precision(cfg)
    ds = render_ds_configs(cfg, world, precision)
    shapes = role_shapes(cfg)  # read once: the estimate and the host share both use them
    est = estimate_memory(cfg, shape, ds, world, precision.rollout, gpu_gib, shapes)
    stages = STAGE_GROUPS.get(stage, (stage,))
    dt = {r: precision.role(r) for r in est["update"] if r not in ("rollout", "process")}
    head = (
        f"## Memory per GPU: {shape.params('lm') / 1e6:.2f}M-parameter model, world size {world}, "
        f"rollout {cfg.rollout.engine}, dtypes {dt}\n\n"
        "Estimate: analytic, from the model config, the DeepSpeed configs and the batch sizes (sequence "
        "length = max_prompt_length + max_new_tokens, an upper bound). Measured: "
        + (
            "tensor accounting during one real step (first step: optimizer states appear at the first "
            "optimizer step; activations = peak bytes saved for backward)."
            if measured
            else "n/a (not built)."
        )
    )
    text = head + "\n\n" + memory_table(est, measured, stages)
    host = {r: c for r, c in host_memory(cfg, shape, ds, world, shapes).items() if c}
    if host:  # offloaded model states (roles.<role>.offload), one rank's share
        parts = ", ".join(f"{r}: " + " + ".join(f"{k} {fmt_bytes(v)}" for k, v in c.items()) for r, c in host.items())
        text += f"\n\nHost memory per rank (offloaded): {parts}."
    if cfg.trainer.rollout_ranks:
        text += "\n\n" + rollout_rank_line(cfg, shape, world, precision.rollout, gpu_gib)
    if gpu_gib:
        ok, peak_stage, peak = verdict({s: est[s] for s in stages}, gpu_gib)
        text += (
            f"\n\n**Verdict: {'fits' if ok else 'does NOT fit'}** on one {gpu_gib:g} GiB GPU per rank: "
            f"estimated peak {fmt_bytes(peak)} in stage `{peak_stage}` "
            f"(includes {GPU_OVERHEAD_GIB:g} GiB CUDA context/allocator allowance)."
        )
    return text


def rollout_rank_line(cfg, shape: ModelShape, world: int, dtype: str, gpu_gib: float | None) -> str:
    """Apart (`trainer.rollout_ranks`): the tables above are a trainer rank's (no engine on it); a rollout
    rank holds its engine alone, generating each of its trainer ranks' rows in turn."""
    engine = choose_engine(cfg.rollout.engine, shape.params("lm"), bool(gpu_gib), 1)[0]
    rcfg = replace(cfg.rollout, engine=engine, sleep=False)  # nothing else wants its memory
    gen = rollout_memory(shape, rcfg, dtype, workload(cfg, world), 0.0, gpu_gib, shape.params("lm") * BYTES[dtype])[
        "rollout"
    ]
    parts = " + ".join(f"{k} {fmt_bytes(v)}" for k, v in gen.items() if v)
    return (
        f"Apart (trainer.rollout_ranks {cfg.trainer.rollout_ranks}): the tables are a trainer rank's, which holds "
        f"no engine; a rollout rank holds its {engine} engine alone: ~{fmt_bytes(sum(gen.values()))} ({parts})."
    )
