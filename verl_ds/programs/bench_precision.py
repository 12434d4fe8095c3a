"""`verl-ds bench precision`: the same training under each precision, side by side.

A cell is (trainer dtype, rollout dtype): the actor, critic and reference compute in the first, the
rollout engine in the second (the reward model keeps its own setting). By default the cells are
each dtype on both sides; `--matrix` runs every pair (fp32/bf16/fp16: 9 cells); `--cells` names a
subset (`fp32,bf16,fp32/bf16`: trainer/rollout, one dtype for both sides). Each cell runs
`steps` trainer steps of the same job and seed. Output: a Markdown table (the rollout-vs-trainer
mismatch at step 1 and over the run, the phantom-clip fraction at step 1 — tokens PPO would clip
on the same weights, precision alone —, peak memory per role, step time, tokens/s, final reward,
overflows and skips, the loss-scale trajectory, and which dtypes ran emulated on this machine), the
same as JSON, and a PNG of the mismatch, loss and reward curves per cell.

On CPU the rollout defaults to HF generate (`rollout.engine=hf`; pass `rollout.engine=vllm` to
override): three vLLM engine starts would dominate the benchmark. fp16 on CPU runs through the
roles' DeepSpeed fp16 shim; on a CPU without 16-bit kernels the roles' GEMMs run as fp32 products
of the 16-bit operands (`precision.cpu_gemm`, verl_ds/gemm.py).
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

from verl_ds.config import load_config
from verl_ds.diagnostics.memory import md_table
from verl_ds.diagnostics.plots import save_panels
from verl_ds.dist import on_gpu
from verl_ds.errors import ConfigError
from verl_ds.precision import COMPUTE_DTYPES, detect_hardware
from verl_ds.trainer.rl_trainer import RLTrainer

log = logging.getLogger(__name__)
PRECISION_KEYS = ("actor_dtype", "critic_dtype", "reference_dtype", "rollout_dtype")


def precision_overrides(dtype: str, rollout: str | None = None) -> list[str]:
    """The trained and reference roles in `dtype`, the rollout engine in `rollout` (default: the same)."""
    return [f"precision.{k}={dtype}" for k in PRECISION_KEYS if k != "rollout_dtype"] + [
        f"precision.rollout_dtype={rollout or dtype}"
    ]


def cells(dtypes: list[str], matrix: bool) -> list[tuple[str, str]]:
    """(trainer, rollout) pairs: each dtype on both sides, or with `matrix` every pair."""
    return [(a, r) for a in dtypes for r in dtypes] if matrix else [(d, d) for d in dtypes]


def parse_cells(text: str) -> list[tuple[str, str]]:
    """`--cells`: a comma list of `trainer/rollout` pairs, or one dtype for both sides."""
    out = []
    for item in (c.strip() for c in text.split(",")):
        parts = item.split("/") if item else []
        if not 1 <= len(parts) <= 2 or any(p not in COMPUTE_DTYPES for p in parts):
            raise ConfigError(
                "--cells",
                f"bad cell {item!r}; use a comma list of DTYPE or TRAINER/ROLLOUT ({', '.join(COMPUTE_DTYPES)})",
            )
        out.append((parts[0], parts[-1]))
    return out


def cell_name(trainer: str, rollout: str) -> str:
    return trainer if trainer == rollout else f"{trainer}/{rollout}"


def parse_dtypes(text: str) -> list[str]:
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in COMPUTE_DTYPES]
    if bad or not dtypes:
        raise ConfigError(
            "--dtypes", f"unknown dtype(s) {bad or text!r}; use a comma list of {', '.join(COMPUTE_DTYPES)}"
        )
    return dtypes


def summarize(cell: tuple[str, str], rows: list[dict], emulated: list[str] = ()) -> dict:
    """One cell's result from its per-step metrics (pure). `emulated`: its dtypes that ran emulated."""

    def series(key):
        return [r.get(key, float("nan")) for r in rows]

    def peak(role):
        vals = [
            v
            for r in rows
            for k, v in r.items()
            if k.startswith("memory/") and k.split("/")[2] == role and k.endswith("/total_mib")
        ]
        return max(vals) if vals else None

    roles = sorted({k.split("/")[2] for r in rows for k in r if k.startswith("memory/")} - {"process"})
    trained = [role for role in ("actor", "critic") if any(f"precision/{role}/skipped_steps" in r for r in rows)]
    proc = [
        v
        for r in rows
        for k, v in r.items()
        if k.startswith("memory/") and "/process/" in k and (k.endswith("rss_mib") or k.endswith("cuda_peak_mib"))
    ]
    timed = rows[1:] if len(rows) > 2 else rows  # the first step pays one-off warm-up costs
    first = rows[0]
    return {
        "dtype": cell_name(*cell),
        "trainer_dtype": cell[0],
        "rollout_dtype": cell[1],
        "emulated": list(emulated),
        "mismatch_step1": first.get("rollout_corr/logprob_abs_diff_mean"),
        "mismatch_max_step1": first.get("rollout_corr/logprob_abs_diff_max"),
        "k3_step1": first.get("rollout_corr/k3_kl"),
        "phantom_clip_step1": first.get("rollout_corr/phantom_clip_fraction"),
        "p99_step1": first.get("rollout_corr/log_ratio_abs_p99"),
        "seq_phantom_clip_step1": first.get("rollout_corr/seq_phantom_clip_fraction"),
        "self_max_step1": first.get("trainer_corr/logprob_abs_diff_max"),
        "mismatch_mean": statistics.mean(series("rollout_corr/logprob_abs_diff_mean")),
        "mismatch": series("rollout_corr/logprob_abs_diff_mean"),
        "steps": len(rows),
        "peak_memory_mib": {role: peak(role) for role in roles},
        "process_peak_mib": max(proc) if proc else None,
        "step_time_s": statistics.mean(r["timing_s/step"] for r in timed),
        "tokens_per_s": statistics.mean(r.get("perf/throughput", float("nan")) for r in timed),
        "final_reward": rows[-1]["reward/mean"],
        "overflows": {role: int(sum(series(f"precision/{role}/overflow"))) for role in trained},
        "skipped_steps": {
            role: int(
                rows[-1].get(f"precision/{role}/skipped_steps", 0) + rows[-1].get(f"precision/{role}/aligned_skips", 0)
            )
            for role in trained
        },
        "loss_scale": series("precision/actor/loss_scale"),
        "loss": series("actor/pg_loss"),
        "reward": series("reward/mean"),
    }


def _fmt(x, spec=".2f"):
    return "n/a" if x is None else format(x, spec)


def markdown(results: list[dict]) -> str:
    roles = sorted({r for res in results for r in res["peak_memory_mib"]})
    header = (
        [
            "dtype (trainer/rollout)",
            "mean abs Δlogprob step 1",
            "over the run",
            "max abs Δlogprob step 1",
            "k3 step 1",
            "phantom clip step 1",
            "abs Δlogprob p99 step 1",
            "seq phantom clip step 1",
            "trainer vs itself, max step 1",
        ]
        + [f"peak {r} (MiB)" for r in roles]
        + [
            "process peak (MiB)",
            "step time (s)",
            "tokens/s",
            "final reward",
            "overflows",
            "skips",
            "loss scale (per step)",
            "emulated here",
        ]
    )
    rows = []
    for res in results:
        rows.append(
            [
                res["dtype"],
                _fmt(res["mismatch_step1"], ".2e"),
                _fmt(res["mismatch_mean"], ".2e"),
                _fmt(res["mismatch_max_step1"], ".2e"),
                _fmt(res["k3_step1"], ".2e"),
                _fmt(res["phantom_clip_step1"], ".2%"),
                _fmt(res.get("p99_step1"), ".2e"),
                _fmt(res.get("seq_phantom_clip_step1"), ".2%"),
                _fmt(res.get("self_max_step1"), ".2e"),
            ]
            + [_fmt(res["peak_memory_mib"].get(r), ".3f") for r in roles]
            + [
                _fmt(res["process_peak_mib"], ".0f"),
                _fmt(res["step_time_s"], ".3f"),
                _fmt(res["tokens_per_s"], ".1f"),
                _fmt(res["final_reward"], ".3f"),
                ", ".join(f"{k} {v}" for k, v in res["overflows"].items()) or "0",
                ", ".join(f"{k} {v}" for k, v in res["skipped_steps"].items()) or "0",
                " → ".join(f"{s:g}" for s in res["loss_scale"]),
                ", ".join(res["emulated"]) or "-",
            ]
        )
    return md_table(header, rows)


def plot(results: list[dict], out_png: Path) -> Path:
    return save_panels(
        [
            (title, [(res["dtype"], range(1, len(res[key]) + 1), res[key], {"marker": "o"}) for res in results])
            for key, title in (
                ("mismatch", "rollout_corr/logprob_abs_diff_mean"),
                ("loss", "actor/pg_loss"),
                ("reward", "reward/mean"),
            )
        ],
        out_png,
    )


def _finite(x):
    """NaN/inf -> None, so the JSON is valid."""
    if isinstance(x, float):
        return x if x == x and abs(x) != float("inf") else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def run_steps(cfg, steps: int) -> list[dict]:
    with RLTrainer(cfg) as trainer:
        return [trainer.step() for _ in range(steps)]


def bench_precision(
    config_path: str | None,
    overrides: list[str],
    dtypes: list[str],
    steps: int,
    out_dir: str | Path,
    matrix: bool = False,
    only: list[tuple[str, str]] | None = None,
) -> dict:
    """Run `steps` steps per cell (`cells`, or the (trainer, rollout) pairs of `only`); write
    bench_precision.{md,json,png} into `out_dir`."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = [] if on_gpu() else ["rollout.engine=hf"]
    hw = detect_hardware()
    results = []
    for trainer, rollout in only or cells(dtypes, matrix):
        name = cell_name(trainer, rollout)
        cfg = load_config(
            config_path,
            base
            + list(overrides)
            + precision_overrides(trainer, rollout)
            + [f"trainer.steps={steps}", f"trainer.run_dir={out / name.replace('/', '_')}"],
        )
        log.info("bench precision: trainer %s, rollout %s, %d steps", trainer, rollout, steps)
        emulated = sorted({d for d in (trainer, rollout) if hw.emulates(d)})
        results.append(summarize((trainer, rollout), run_steps(cfg, steps), emulated))
    table = markdown(results)
    what = "cell (trainer dtype x rollout dtype)" if matrix or only else "dtype"
    (out / "bench_precision.md").write_text(f"# bench precision ({steps} steps per {what}, {hw.device})\n\n{table}\n")
    (out / "bench_precision.json").write_text(json.dumps(_finite({"steps": steps, "results": results}), indent=2))
    plot(results, out / "bench_precision.png")
    return {"table": table, "results": results, "out_dir": str(out)}
