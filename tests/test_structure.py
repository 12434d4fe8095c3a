"""The structure docs/ARCHITECTURE.md describes, checked: the layers (import-linter's contract in
setup.cfg), no import circle between any two modules (function-level imports included), and the
decisions that have exactly one home."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "verl_ds"


def test_layers_contract_is_kept():
    """setup.cfg's [importlinter] layers: a module imports only from the layers below its own."""
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    proc = subprocess.run([exe, "--config", str(ROOT / "setup.cfg")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 kept, 0 broken" in proc.stdout


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_modules():
    """No two modules import each other, directly or through others, even from inside a function
    (where a circle hides from Python's import machinery but not from the reader)."""
    g = grimp.build_graph("verl_ds")
    edges = {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}
    assert _circles(edges) == []
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check itself


# A CPU feature flag as the code would test it: an exact string, or the flag set of `Hardware`.
_FLAG = re.compile(r"(avx|amx|sse|fma|neon|sve)\w*", re.I)


def _flag_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if _FLAG.fullmatch(node.value) or "/proc/cpuinfo" in node.value:
                uses.append(node.value)
        elif isinstance(node, ast.Attribute) and node.attr in ("cpu_flags", "_cpu_flags"):
            uses.append(node.attr)
    return uses


def test_only_precision_knows_cpu_flags():
    """One home for the hardware rule: no module but precision.py reads /proc/cpuinfo, names a CPU
    flag or looks into `Hardware.cpu_flags` (others ask `Hardware.cpu_bf16` or `auto_compute_dtype`)."""
    users = sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py") if _flag_uses(p))
    assert users == ["precision.py"], {u: _flag_uses(PKG / u) for u in users}


def test_only_dist_decides_the_device():
    """One home for "CUDA or CPU": `dist.on_gpu`; no other module asks torch whether a GPU is there."""
    users = sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py") if "cuda.is_available" in p.read_text())
    assert users == ["dist.py"], users


# DeepSpeed / vLLM / torch internals the project reads, each name with its one home (the adapters:
# roles/ds_internals.py, rollout/engines/vllm_internals.py; process.py holds the process-wide compile switch).
_INTERNALS = {
    "roles/ds_internals.py": {
        "ds_id",
        "ds_tensor",
        "ds_numel",
        "GatheredParameters",
        "grad_partitions_flat_buffer",
        "averaged_gradients",
        "single_partition_of_fp32_groups",
        "fp32_partitioned_groups_flat",
        "lp_param_buffer",
        "fp32_groups_flat_partition",
        "cur_scale",
        "enable_backward_allreduce",
        "is_fp16_supported",
        "supported_dtypes",
        "_release_process_group_references",
    },
    "rollout/engines/vllm_internals.py": {
        "llm_engine",
        "engine_core",
        "_finalizer",
        "disable_envs_cache",
        "reload_weights",
        "get_model",
    },
    "process.py": {"_dynamo"},
}
# Private (`._x`) attributes read on something other than `self`/`cls` outside the adapters: none but
# these (module path, expression). `os._exit` is public (documented) wherever it appears.
_PRIVATE_ALLOWED = {
    ("cli.py", "atexit._run_exitfuncs"),  # CPython's, not a library's: exit handlers, then os._exit
}
_ADAPTERS = ("roles/ds_internals.py", "rollout/engines/vllm_internals.py")


def _internal_reads(rel: str, source: str) -> list[str]:
    """`line: expression` of every internal read in `source` (module `rel`) that is not at home: an
    attribute (or a getattr/hasattr/setattr name) from `_INTERNALS` outside its module, or a private
    attribute of anything but self/cls outside the adapters and `_PRIVATE_ALLOWED`."""
    home = {name: mod for mod, names in _INTERNALS.items() for name in names}
    out = []
    for node in ast.walk(ast.parse(source)):
        name = None
        if isinstance(node, ast.Attribute):
            name, base = node.attr, node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name, base = node.args[1].value, node.args[0]
        if name is None:
            continue
        expr = f"{node.lineno}: {ast.unparse(node)}"
        if name in home:
            if home[name] != rel:
                out.append(expr)
        elif name.startswith("_") and not name.startswith("__") and rel not in _ADAPTERS:
            owner = ast.unparse(base)
            if owner not in ("self", "cls", "os") and (rel, f"{owner}.{name}") not in _PRIVATE_ALLOWED:
                out.append(expr)
    return out


def test_internals_are_read_only_in_their_adapters():
    """Every DeepSpeed/vLLM/torch internal goes through its adapter, so a version bump that moves one
    fails in tests/roles/test_ds_internals.py (or the rollout tests), by name, and is mended in one
    file."""
    found = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        if reads := _internal_reads(rel, p.read_text()):
            found[rel] = reads
    assert found == {}
    # the check itself: each kind of read is caught outside its home, and allowed inside it
    probe = (
        "x = opt.averaged_gradients\ny = getattr(p, 'ds_id', None)\nz = llm.llm_engine\nw = torch._dynamo\nv = a._b\n"
    )
    assert len(_internal_reads("roles/base.py", probe)) == 5
    assert _internal_reads("roles/ds_internals.py", probe) == ["3: llm.llm_engine", "4: torch._dynamo"]
    assert _internal_reads("roles/base.py", "self._x\ncls._y\nos._exit(0)\n") == []
