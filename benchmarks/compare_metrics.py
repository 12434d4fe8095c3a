"""Two runs' metrics.jsonl, compared value by value: the check that a change which should not move a
number did not (a refactor, a faster path). Timings, memory and throughput are left out; every other
key must be present in both and bitwise equal at every step.

    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 RUN_DIR=runs/qs_before \\
        bash launch/quickstart.sh precision.actor_dtype=fp32 precision.reference_dtype=fp32 \\
        precision.rollout_dtype=fp32 logging.wandb.mode=disabled       # before (a worktree of the old commit)
    ... RUN_DIR=runs/qs_after bash launch/quickstart.sh ...              # after
    python benchmarks/compare_metrics.py runs/qs_before/metrics.jsonl runs/qs_after/metrics.jsonl

Exit 0 when equal, 1 with the first differences listed.
"""

from __future__ import annotations

import json
import sys

VOLATILE = ("timing_s/", "memory/", "perf/throughput", "perf/rollout_tokens_per_s")


def rows(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


def differences(a: list[dict], b: list[dict]) -> tuple[int, list[str]]:
    """(values compared, what differs)."""
    if len(a) != len(b):
        return 0, [f"{len(a)} rows against {len(b)}"]
    n, out = 0, []
    for ra, rb in zip(a, b):
        ka = {k for k in ra if not k.startswith(VOLATILE)}
        kb = {k for k in rb if not k.startswith(VOLATILE)}
        if ka != kb:
            out.append(f"step {ra.get('step')}: keys only in one run: {sorted(ka ^ kb)}")
        for k in sorted(ka & kb):
            n += 1
            same = ra[k] == rb[k] or (ra[k] != ra[k] and rb[k] != rb[k])  # NaN equals NaN here
            if not same:
                out.append(f"step {ra.get('step')}: {k} {ra[k]!r} != {rb[k]!r}")
    return n, out


def main() -> int:
    a, b = rows(sys.argv[1]), rows(sys.argv[2])
    n, diff = differences(a, b)
    keys = len({k for r in a for k in r if not k.startswith(VOLATILE)})
    print(f"{len(a)} rows, {n} values of {keys} keys compared; {len(diff)} differ")
    for line in diff[:20]:
        print(" ", line)
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
