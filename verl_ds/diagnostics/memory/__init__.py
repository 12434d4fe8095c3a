"""Memory per stage and role: an analytic estimate (`estimate`), a measured account during real
steps (`measure`), and Markdown tables / the `debug memory` report (`tables`)."""

from .estimate import (
    BYTES,
    COMPONENTS,
    GIB,
    MIB,
    STAGE_GROUPS,
    STAGES,
    ModelShape,
    Workload,
    choose_zero_stages,
    estimate_memory,
    peak_by_role,
    role_memory,
    stage_totals,
    verdict,
    workload,
)
from .measure import MemoryTimer, account_role, process_memory, stages_from_metrics
from .tables import compare_table, fmt_bytes, load_shape, md_table, memory_table, report, role_shapes

__all__ = [
    "BYTES",
    "choose_zero_stages",
    "COMPONENTS",
    "GIB",
    "MIB",
    "STAGE_GROUPS",
    "STAGES",
    "ModelShape",
    "Workload",
    "estimate_memory",
    "peak_by_role",
    "role_memory",
    "stage_totals",
    "verdict",
    "workload",
    "MemoryTimer",
    "account_role",
    "process_memory",
    "stages_from_metrics",
    "compare_table",
    "fmt_bytes",
    "load_shape",
    "md_table",
    "memory_table",
    "report",
    "role_shapes",
]
