"""Verdicts, tables and the `precision:` YAML block of `verl-ds debug precision` (pure: numbers in,
text out). Measurements come from `programs/precision_advisor.py`.

A role is flagged when bf16 or fp16 would damage its numbers: output relative error above
`REL_TOL`; reward score differences within a group erased above `VANISH_TOL`; values, weights or
(unscaled) gradients beyond fp16's max; more than `UNDER_TOL` of the nonzero gradients below the
dtype's smallest normal at the loss scale the dtype would run with (fp16: the role's loss scale
when it runs fp16, else its configured 2**initial_scale_power; bf16/fp32: 1); skipped fp16 steps.
"""

from __future__ import annotations

import math

import yaml

from verl_ds.diagnostics.memory import fmt_bytes, md_table
from verl_ds.precision import COMPUTE_DTYPES, PrecisionConfig, resolve_precision

EXP_OFFSET, EXP_BINS = 160, 320  # gradient histogram: frexp exponents of fp32 values lie in [-148, 129]

REL_TOL, VANISH_TOL, UNDER_TOL = 0.05, 0.05, 0.01
FP16_MAX = 65504.0
TINY_POW = {"fp16": -14, "bf16": -126, "fp32": -126}  # smallest normal = 2**TINY_POW
MAX_POW = {"fp16": 16, "bf16": 128, "fp32": 128}  # overflow: |x| >= 2**MAX_POW (fp16: ~65504)


def scale_power(m: dict, dtype: str) -> int:
    """log2 of the loss scale `dtype` would run this role's gradients with."""
    if dtype != "fp16" or not m["trainable"]:
        return 0
    return round(math.log2(m["loss_scale"][-1])) if m["dtype"] == "fp16" else int(m["init_scale_power"])


def grad_fractions(m: dict, dtype: str, k: int) -> tuple[float, float]:
    """(underflow, overflow) fractions of the finite nonzero gradient elements multiplied by 2**k."""
    h = m["grad_hist"]
    n = sum(h)
    if not n:
        return 0.0, 0.0

    def idx(e):
        return min(max(e + EXP_OFFSET, 0), EXP_BINS)

    return sum(h[: idx(TINY_POW[dtype] - k + 1)]) / n, sum(h[idx(MAX_POW[dtype] + 1 - k) :]) / n


def safe_scale_power(m: dict) -> int | None:
    """The largest power of two <= fp16 max / max|grad| (unscaled): no overflow at the first step;
    below every scale at which an fp16 role's own gradients overflowed (their max is then unknown)."""
    if not m.get("grad_max"):
        return None
    k = math.floor(math.log2(FP16_MAX / m["grad_max"]))
    return min([k] + [math.floor(math.log2(s)) - 1 for s in m.get("overflow_scales", [])])


def problems(m: dict, dtype: str) -> list[tuple[str, str]]:
    """(kind, text) of what `dtype` would do wrong to this role; kinds: scale (fixable by the fp16
    loss scale), other."""
    out = []
    rel = m["rel_err"][dtype]
    if not rel <= REL_TOL:
        out.append(("other", f"output relative error {rel:.1%} in {dtype}"))
    lost = m.get("vanish", {}).get(dtype, 0.0)
    if lost > VANISH_TOL:
        out.append(("other", f"{lost:.0%} of within-group score differences vanish in {dtype}"))
    big = max(m["act_max"], m["head_max"], m["weight_max"])
    if not big <= (FP16_MAX if dtype == "fp16" else 2.0 ** MAX_POW[dtype]):
        out.append(("other", f"activations/weights reach {big:.3g} > {dtype} max"))
    if m["trainable"]:
        k = scale_power(m, dtype)
        under, _ = grad_fractions(m, dtype, k)
        if under > UNDER_TOL:
            out.append(
                (
                    "scale",
                    f"{under:.0%} of gradients underflow {dtype} at loss scale 2^{k} (max |grad| {m['grad_max']:.2g})",
                )
            )
        if grad_fractions(m, dtype, 0)[1] > 0:
            out.append(("other", f"gradients exceed {dtype} max even unscaled"))
        own = m.get("skipped_steps", 0) - m.get("aligned_skips", 0)  # not the partner role's overflow
        if dtype == "fp16" == m["dtype"] and own > 0:
            out.append(
                (
                    "scale",
                    f"fp16 skipped {int(own)} of {m['opt_steps']} optimizer steps for overflow "
                    f"(initial_scale_power {safe_scale_power(m)} would avoid it)",
                )
            )
    return out


def advise(name: str, m: dict, auto_dtype: str) -> dict:
    """{dtype, scale_power, flagged, reason}: one recommendation per role."""
    cur = m["dtype"]
    if cur == "int8":
        return {
            "dtype": cur,
            "scale_power": None,
            "flagged": False,
            "reason": "int8: weight-only quantization, not analysed (the bf16/fp16 rows cast the fp32 weights)",
        }
    pb = {d: problems(m, d) for d in ("bf16", "fp16")}
    if not any(pb.values()):
        under = (
            f", fp16 grad underflow {grad_fractions(m, 'fp16', scale_power(m, 'fp16'))[0]:.2%}" if _has_grads(m) else ""
        )
        return {
            "dtype": cur,
            "scale_power": None,
            "flagged": False,
            "reason": f"{cur}: no range problem (rel. error bf16 {m['rel_err']['bf16']:.2%}, "
            f"fp16 {m['rel_err']['fp16']:.2%}{under})",
        }
    k = safe_scale_power(m) if m["trainable"] else None
    fixable = (
        bool(pb["fp16"])
        and all(kind == "scale" for kind, _ in pb["fp16"])
        and k is not None
        and grad_fractions(m, "fp16", k)[0] <= UNDER_TOL
    )
    fp16_text = f"fp16 with initial_scale_power {k}" if fixable else "fp16"

    def rec(dtype, text, power=None):
        return {"dtype": dtype, "scale_power": power, "flagged": True, "reason": f"{text}"}

    if cur in pb and not pb[cur]:
        other = "fp16" if cur == "bf16" else "bf16"
        return rec(cur, f"{cur}: keep it; {other} would: {pb[other][0][1]}")
    if fixable and (auto_dtype == "fp16" or pb["bf16"]):
        return rec("fp16", f"{fp16_text}: {pb['fp16'][0][1]}; 2^{k} is the largest scale without early overflow", k)
    if not pb["bf16"]:
        return rec("bf16", f"bf16: {pb['fp16'][0][1]}")
    if not pb["fp16"]:
        return rec("fp16", f"fp16: {pb['bf16'][0][1]}")
    return rec("fp32", f"fp32: {pb['bf16'][0][1]}; {pb['fp16'][0][1]}")


def rollout_advice(advice: dict, roles: dict) -> dict | None:
    """The rollout's recommendation: the actor's dtype (`rollout_dtype: auto` follows it), since a
    trainer and a rollout in different dtypes differ by rounding before any update. When the actor's
    own measured logprob error is smaller in fp16 than in bf16 and fp16 has no range problem for it,
    say that fp16 on both sides keeps them closer. None without an actor's logprob measurements."""
    m = roles.get("actor", {})
    if "actor" not in advice or "logprob_gap" not in m:
        return None
    dt, gap = advice["actor"]["dtype"], m["logprob_gap"]
    reason = (
        f"auto: the actor's {dt} (a dtype that differs on either side adds its rounding before any update; "
        f"the actor's max |Δlogprob| vs fp32: bf16 {gap['bf16']:.3g}, fp16 {gap['fp16']:.3g})"
    )
    if dt == "bf16" and gap["fp16"] < gap["bf16"] and not problems(m, "fp16"):
        reason += "; fp16 on both sides keeps them closer: actor_dtype fp16"
    return {"dtype": "auto", "scale_power": None, "flagged": False, "reason": reason}


def precision_block(advice: dict) -> str:
    """The `precision:` YAML block of the recommendations (fp16 ones with their initial_scale_power)."""
    block = {f"{name}_dtype": a["dtype"] for name, a in advice.items()}
    for name, a in advice.items():
        if a["dtype"] == "fp16" and a["scale_power"] is not None:
            block[f"{name}_loss_scaling"] = {"initial_scale_power": int(a["scale_power"])}
    return yaml.safe_dump({"precision": block}, sort_keys=False)


def _has_grads(m: dict) -> bool:
    return m["trainable"] and sum(m["grad_hist"]) > 0


def _run_scale_fractions(m: dict) -> str:
    """Gradient elements below fp16's smallest normal / above its max at the run's loss scale (1 if not fp16)."""
    if not _has_grads(m):
        return "-"
    k = scale_power(m, "fp16") if m["dtype"] == "fp16" else 0
    return " / ".join(_pct(x) for x in grad_fractions(m, "fp16", k)) + f" @2^{k}"


def _pct(x):
    return f"{x:.2%}"


def _dtype_rows(roles: dict, mem: dict[str, dict[str, float]]) -> list[list[str]]:
    """Per role and dtype: its error against fp32, its gradients' fractions lost, its weights, its forward time."""
    table = []
    for name, m in roles.items():
        for dt in COMPUTE_DTYPES:
            k = scale_power(m, dt)
            grads = (
                [f"{x:.2%} @2^{k}" for x in grad_fractions(m, dt, k)]
                if _has_grads(m)
                else ["no nonzero grads" if m["trainable"] else "-"] * 2
            )
            gap = f"{m['logprob_gap'][dt]:.3g}" if "logprob_gap" in m else "-"
            table.append(
                [name, dt, _pct(m["rel_err"][dt]), gap, *grads, fmt_bytes(mem[name][dt]), f"{m['fwd_s'][dt]:.3f}"]
            )
    return table


def _range_rows(roles: dict) -> list[list[str]]:
    """Per role: the ranges of its weights, activations, outputs and gradients, and the fp16 scale they allow."""
    ranges = []
    for name, m in roles.items():
        lost = m.get("vanish")
        ranges.append(
            [
                name,
                m["dtype"],
                f"{m['weight_max']:.3g}",
                f"{m['act_max']:.3g}",
                f"[{m['out_range'][0]:.4g}, {m['out_range'][1]:.4g}]",
                f"{m['grad_max']:.3g}" if m["trainable"] else "-",
                _run_scale_fractions(m),
                str(safe_scale_power(m)) if m["trainable"] and m["grad_max"] else "-",
                (f"{_pct(lost['bf16'])} / {_pct(lost['fp16'])} of {m['pairs']}" if lost else "-"),
            ]
        )
    return ranges


def build_report(
    roles: dict,
    rows: list[dict],
    mem: dict[str, dict[str, float]],
    world: int,
    hw,
    steps: int,
    seconds: float,
    notes: list[str] = (),
) -> dict:
    """(Long on purpose: the report's text, section after section, as a reader sees it.)
    `roles`: each role's measurements; `mem`: its weight bytes per dtype (`weight_memory`)."""
    auto = resolve_precision(PrecisionConfig(), hw, log_choice=False).auto_choice  # what `auto` means here
    advice = {name: advise(name, m, auto) for name, m in roles.items()}
    table, ranges = _dtype_rows(roles, mem), _range_rows(roles)
    lines = [
        f"## debug precision: {steps} steps, world size {world}, {hw.device}, `auto` = {auto}",
        "",
        "What each dtype would do (rel. error: the role's output — logprobs, values or scores — vs fp32 "
        "on the last batch; gradient fractions at the loss scale the dtype would run with; weights: analytic "
        "estimate as in `debug memory`).",
        "",
        md_table(
            [
                "role",
                "dtype",
                "rel. error",
                "max abs Δlogprob",
                "grad underflow",
                "grad overflow",
                "weights (est.)",
                "forward (s)",
            ],
            table,
        ),
        "",
        md_table(
            [
                "role",
                "run dtype",
                "max abs weight",
                "max abs activation",
                "output range",
                "max abs grad (unscaled)",
                "grad below fp16 normal / above fp16 max, at the run's scale",
                "fp16 initial_scale_power (no early overflow)",
                "score diffs lost bf16 / fp16",
            ],
            ranges,
        ),
        "",
    ]
    for name, m in roles.items():
        if m["trainable"] and m["dtype"] == "fp16":
            lines.append(
                f"{name} loss scale: {' → '.join(f'{s:g}' for s in m['loss_scale'])}; "
                f"skipped steps: {int(m['skipped_steps'])} "
                f"({int(m['aligned_skips'])} for the partner's overflow)"
            )
    gap = rows[-1].get("rollout_corr/logprob_abs_diff_max")
    if gap is not None:
        lines.append(f"rollout vs trainer in this run: max |Δlogprob| {gap:.3g}")
    if hw.device == "cpu":
        slow = "fp16 is emulated on CPU" + ("; bf16 is emulated without avx512_bf16/AMX" if hw.emulates("bf16") else "")
        lines.append(f"note: forward timings are not representative here ({slow}); the numerics are.")
    lines += list(notes) + ["", "### Recommendations"]
    rollout = rollout_advice(advice, roles)
    recs = {**advice, **({"rollout": rollout} if rollout else {})}
    for name, a in recs.items():
        lines.append(f"- {name}{' (flagged)' if a['flagged'] else ''}: {a['reason']}")
    text = precision_block(recs)
    lines += ["", "```yaml", text.rstrip(), "```", "", f"debug precision took {seconds:.1f} s"]
    return {"report": "\n".join(lines), "yaml": text, "recommendations": advice, "memory": mem, "seconds": seconds}
