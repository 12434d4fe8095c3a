"""Atomic, rotating checkpoints of every trained role plus the trainer state.

Layout: <run_dir>/checkpoints/step_<k>/{actor,critic}/ (DeepSpeed) + trainer_state.json + rng.pt.
All ranks write into `.step_<k>.tmp`; rank 0 renames it once everyone is done, so a crash never
leaves a half-written `step_<k>` that `resume: auto` would pick.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import torch

from verl_ds.dist import barrier, rank
from verl_ds.errors import ConfigError
from verl_ds.roles.params import swap_in

_STEP = re.compile(r"^step_(\d+)$")


def list_checkpoints(root: Path) -> list[Path]:
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def save_checkpoint(root: Path, step: int, roles: dict, state: dict, keep_last: int) -> Path:
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    for name, role in roles.items():
        role.save(str(tmp / name), tag="ds")
    if rank() == 0:
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}, indent=2))
    # per-rank RNG (sampling seeds differ per rank)
    torch.save(
        {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]), "python_pos": random.getstate()[2]},
        tmp / f"rng_rank{rank()}.pt",
    )
    barrier()
    if rank() == 0:
        swap_in(tmp, final)  # by renames (.step_<k>.old between): a complete step_<k> always exists
        for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(path: Path, roles: dict) -> dict:
    """Restore roles and RNG; return the trainer state dict (step, sampler, kl, reward_norm)."""

    missing = [
        p.name
        for p in [path / "trainer_state.json", path / f"rng_rank{rank()}.pt", *(path / name for name in roles)]
        if not p.exists()
    ]
    if missing:
        raise ConfigError(
            "trainer.resume", f"{path} is not a complete verl-ds checkpoint (missing: {', '.join(missing)})"
        )
    for name, role in roles.items():
        role.load(str(path / name), tag="ds")
    rng = torch.load(path / f"rng_rank{rank()}.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    random.setstate((3, tuple(rng["python"]), rng["python_pos"]))
    return json.loads((path / "trainer_state.json").read_text())
