"""Checkpoint facts both rollout engines need: parameter names/shapes, eos ids, and a checker.

Names and shapes come from the safetensors headers (no tensor is read), once at start-up, so a
bad sync is refused before anything reaches an engine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

TIED_HEAD = "lm_head.weight"


def checkpoint_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """{hf_name: shape} over every *.safetensors file of an HF directory (headers only)."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path}: no *.safetensors files")
    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                shapes[k] = tuple(sf.get_slice(k).get_shape())
    return shapes


def safetensors_damage(path: str | Path) -> str | None:
    """What makes a safetensors file unloadable (None: nothing), from its layout alone: an 8-byte
    little-endian header length, a JSON header, then the tensors' bytes, the last ending at the end of
    the file. A copy cut short or a disk that filled leaves a file shorter than its header says."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"{size} bytes: too short for a safetensors file"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"the header says {n} bytes, the file holds {size - 8} after the length: cut short?"
        try:
            header = json.loads(fh.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            return f"not a safetensors file (its header does not parse: {e})"
    if 8 + n + end > size:
        return f"cut short: {size} bytes, its header needs {8 + n + end}"
    return None


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def eos_token_ids(model_path: str | Path) -> list[int]:
    """The model's eos id(s): generation_config.json first, then config.json."""
    p = Path(model_path)
    for cfg in (_json(p / "generation_config.json"), _json(p / "config.json")):
        eos = cfg.get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    raise ValueError(f"{model_path}: no eos_token_id in generation_config.json or config.json")


def pad_token_id(model_path: str | Path) -> int:
    p = Path(model_path)
    for cfg in (_json(p / "generation_config.json"), _json(p / "config.json")):
        if cfg.get("pad_token_id") is not None:
            return int(cfg["pad_token_id"])
    return eos_token_ids(model_path)[0]


class ParamChecker:
    """Checks streamed `(name, tensor)` pairs against the checkpoint's names and shapes."""

    def __init__(self, model_path: str | Path):
        self.expected = checkpoint_shapes(model_path)
        tie = _json(Path(model_path) / "config.json").get("tie_word_embeddings", False)
        self.tied = tie and TIED_HEAD not in self.expected
        # the input embedding a tied head shares (vLLM's in-place reload needs it sent twice)
        self.tied_source = next((k for k in self.expected if k.endswith("embed_tokens.weight")), None)
        self.seen: set[str] = set()

    def begin(self) -> None:
        self.seen = set()

    def check(self, name: str, tensor: torch.Tensor) -> bool:
        """Raise ValueError on an unknown name or wrong shape. False: skip it (a tied lm_head)."""
        if name in self.seen:
            raise ValueError(f"weight sync: parameter {name!r} sent twice")
        if name == TIED_HEAD and self.tied:
            return False
        if name not in self.expected:
            hint = " (strip the 'module.' prefix)" if name.startswith("module.") else ""
            raise ValueError(
                f"weight sync: unknown parameter {name!r}{hint}; the rollout model has e.g. {sorted(self.expected)[:3]}"
            )
        if tuple(tensor.shape) != self.expected[name]:
            raise ValueError(
                f"weight sync: parameter {name!r} has shape {tuple(tensor.shape)}, "
                f"the rollout model expects {self.expected[name]}"
            )
        self.seen.add(name)
        return True

    def finish(self) -> None:
        """Raise if some expected parameter never came (a partial sync is silent corruption)."""
        missing = sorted(set(self.expected) - self.seen)
        if missing:
            raise ValueError(f"weight sync: {len(missing)} parameter(s) missing, e.g. {missing[:3]}")


FINGERPRINT_VALUES = 65536  # values read per tensor at most: a sync's check stays ~free at any model size


def fingerprint(t: torch.Tensor) -> tuple[float, float]:
    """(sum, sum of squares) in float64 of an evenly strided sample of a tensor's values (all of them
    up to FINGERPRINT_VALUES): the same values give the same pair (to float64 rounding of the sums),
    a weight update changes it. The stride depends only on the size, so both sides read the same
    positions; at a stride below the row length every row is read (an update changes whole rows)."""
    x = t.detach().reshape(-1)
    x = x[:: max(1, x.numel() // FINGERPRINT_VALUES)].double()
    return float(x.sum()), float(x.square().sum())


def same_fingerprint(a: tuple[float, float] | None, b: tuple[float, float]) -> bool:
    return a is not None and all(abs(x - y) <= 1e-12 * max(abs(x), abs(y), 1e-30) for x, y in zip(a, b))


def sync_mismatch(version: int, got_version: int, got: dict, want: dict) -> str | None:
    """The one line that says a sync did not reach the engine (None: it did): the version the
    engine last loaded, or the first parameter whose read-back fingerprint differs."""
    if got_version != version:
        return f"the rollout engine last loaded sync {got_version}, not sync {version}"
    bad = [n for n in want if not same_fingerprint(got.get(n), want[n])]
    if not bad:
        return None
    n = bad[0]
    have = "absent" if got.get(n) is None else f"sum {got[n][0]:.9g}"
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return (
        f"the rollout engine does not hold the actor's {n} after sync {version}: "
        f"engine {have}, actor sum {want[n][0]:.9g}{more}"
    )


def layer_group(name: str) -> str:
    """Bucket boundaries fall between groups: everything under `...layers.N.` stays together,
    because vLLM fuses q/k/v and gate/up of one layer and a half-loaded fused layer is garbage."""
    m = re.match(r"(.*?\.\d+)\.", name)
    return m.group(1) if m else name.rsplit(".", 1)[0]
