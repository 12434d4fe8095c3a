"""Atomic, rotating checkpoints of every trained role plus the trainer state.

Layout: <run_dir>/checkpoints/step_<k>/{actor,critic}/ (DeepSpeed) + trainer_state.json + rng_rank<r>.pt
(+ rank<r>_state.json: what a rank keeps of its own, e.g. partial rollouts in flight).
All ranks write into `.step_<k>.tmp`; rank 0 renames it once everyone is done, so a crash never
leaves a half-written `step_<k>` that `resume: auto` would pick.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_ds.dist import barrier, rank
from verl_ds.errors import ConfigError, RunFailure
from verl_ds.roles.params import export_adapter, export_hf, swap_in

_STEP = re.compile(r"^step_(\d+)$")
log = logging.getLogger(__name__)


def list_checkpoints(root: Path) -> list[Path]:
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def save_checkpoint(
    root: Path, step: int, roles: dict, state: dict, keep_last: int, rank_state: dict | None = None
) -> Path:
    """Write `step_<step>` atomically; a write that fails (a full disk, a directory made read-only)
    leaves the previous checkpoints as they were and ends the run in one line that names the newest.
    `state`: rank 0's trainer state; `rank_state`: this rank's own (every rank writes one)."""
    try:
        return _save(root, step, roles, state, keep_last, rank_state)
    except OSError as e:
        if rank() == 0:
            shutil.rmtree(root / f".step_{step}.tmp", ignore_errors=True)
        raise RunFailure(f"writing checkpoint step_{step} failed ({e}); {last_good(root)}") from None


def last_good(root: Path) -> str:
    """Where a run that could not write continues from, in words."""
    done = list_checkpoints(root)
    if not done:
        return f"no checkpoint was written under {root} yet"
    return f"the last good checkpoint is {done[-1]} (trainer.resume: auto continues from it)"


def _save(root: Path, step: int, roles: dict, state: dict, keep_last: int, rank_state: dict | None) -> Path:
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
    if rank_state is not None:
        (tmp / f"rank{rank()}_state.json").write_text(json.dumps(rank_state))
    barrier()
    if rank() == 0:
        swap_in(tmp, final)  # by renames (.step_<k>.old between): a complete step_<k> always exists
        for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def damage(path: Path, roles: list[str], ranks: int) -> str | None:
    """What makes checkpoint `path` unusable (None: nothing): a file it needs missing,
    trainer_state.json not parsing, or a `.pt` file that is not a whole torch archive (a disk that
    filled, a copy cut short: its zip directory, written last, is missing). Reads the JSON and each
    archive's directory, not the tensors: cheap enough to run before any engine is built."""
    needed = ["trainer_state.json", *(f"rng_rank{r}.pt" for r in range(ranks)), *roles]
    missing = [n for n in needed if not (path / n).exists()]
    if missing:
        return f"missing {', '.join(missing)}"
    try:
        _trainer_state(path)
    except (ValueError, UnicodeDecodeError) as e:
        return f"trainer_state.json does not parse ({e})"
    for f in sorted(path.rglob("*.pt")):
        try:
            zipfile.ZipFile(f).close()
        except (zipfile.BadZipFile, OSError) as e:
            return f"{f.relative_to(path)} is not a whole torch file ({e})"
    return None


def probe_writable(path: Path, key: str) -> None:
    """Write a file once where `path` will be made (its nearest existing ancestor), before any work: a
    directory the run cannot write is one line now, not a PermissionError after a step has trained.
    Nothing is created, so a run refused later (a data file's mistake) leaves no empty folders."""
    there = path
    while not there.exists() and there != there.parent:
        there = there.parent
    try:
        if not there.is_dir():
            raise NotADirectoryError(f"{there} is not a directory")
        probe = there / f".write_probe_{rank()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(key, f"{path} is not writable ({e.strerror or e})") from None


def pick_resume(
    root: Path, resume: str, roles: list[str], ranks: int, sp: int = 1, rollout_ranks: int = 0
) -> Path | None:
    """`trainer.resume` resolved and checked before any engine is built: `none` -> None; `auto` -> the
    newest intact checkpoint under `root` (a damaged newer one is passed over in one log line) or
    None; a path -> that checkpoint, a ConfigError naming what is wrong with it. A checkpoint another
    number of ranks wrote is refused in one line (`check_placement`), not passed over."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise ConfigError("trainer.resume", f"checkpoint directory not found: {path}")
        check_placement(path, ranks, sp, rollout_ranks)
        if problem := damage(path, roles, ranks):
            raise ConfigError("trainer.resume", f"{path} is not a usable verl-ds checkpoint: {problem}")
        return path
    for path in reversed(list_checkpoints(root)):
        check_placement(path, ranks, sp, rollout_ranks)
        problem = damage(path, roles, ranks)
        if problem is None:
            return path
        log.warning("resume: auto passes over %s: %s", path, problem)
    log.info("resume: auto found no intact checkpoint in %s; starting fresh", root)
    return None


def check_placement(path: Path, ranks: int, sp: int, rollout_ranks: int = 0) -> None:
    """A checkpoint resumes on the number of ranks that wrote it (ZeRO's partitions, each rank's RNG and
    partial rollouts are per rank): another world is one line, and so is another number of rollout ranks
    (apart, a checkpoint holds the next step's rows, sampled a step behind; colocated, none). The
    sequence-parallel size may differ: a group's ranks partition the parameters over the whole world
    either way, so the checkpoint is the same (docs/GUIDE.md, "Resuming")."""
    written = _placement(path)
    apart = written.get("rollout_ranks", 0)
    if apart != rollout_ranks:
        raise ConfigError(
            "trainer.rollout_ranks",
            f"{path} was written with trainer.rollout_ranks {apart} and this run has {rollout_ranks}: apart, a "
            f"checkpoint holds the next step's rows, sampled on the weights before; resume it with {apart}",
        )
    world = written.get("world") or len(list(path.glob("rng_rank*.pt")))  # before placements were recorded
    if world and world != ranks:
        raise ConfigError(
            "trainer.resume",
            f"{path} was written by {world} ranks and this run has {ranks}: ZeRO's partitions, each rank's RNG and "
            f"partial rollouts are per rank; resume it on {world} ranks (trainer.sequence_parallel_size may differ)",
        )
    if written.get("sequence_parallel_size", sp) != sp:
        log.info(
            "resume: %s was written at trainer.sequence_parallel_size %d, this run splits rows over %d: the same "
            "checkpoint (ZeRO partitions every rank's share of the parameters either way)",
            *(path, written["sequence_parallel_size"], sp),
        )


def _trainer_state(path: Path) -> dict:
    """Checkpoint `path`'s trainer_state.json (rank 0's state, the step, the placement), parsed."""
    return json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))


def resumed_step(path: Path) -> int:
    """The step checkpoint `path` was written after (`pick_resume` checked its files)."""
    return int(_trainer_state(path)["step"])


def _placement(path: Path) -> dict:
    """The ranks a checkpoint was written by, as `LoopState.save` records them ({} where it did not)."""
    try:
        placement = _trainer_state(path).get("placement")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return {}  # `damage` names what is wrong with the file
    return placement if isinstance(placement, dict) else {}


def load_checkpoint(path: Path, roles: dict) -> dict:
    """Restore roles and RNG; return the trainer state dict (step, sampler, kl, reward_norm; `rank`:
    this rank's own state, None when it wrote none). `path` is whole: `pick_resume` checked it
    before any engine was built."""
    for name, role in roles.items():
        role.load(str(path / name), tag="ds")
    rng = torch.load(path / f"rng_rank{rank()}.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    random.setstate((3, tuple(rng["python"]), rng["python_pos"]))
    state = _trainer_state(path)
    own = path / f"rank{rank()}_state.json"
    state["rank"] = json.loads(own.read_text()) if own.exists() else None
    return state


@dataclass
class LoopState:
    """What the loop keeps beside the trained roles, checkpointed with them: the prompt sampler, the KL
    controller, the reward statistics (shared by every rank: rank 0 writes them) and the partial
    rollouts in flight (each rank's pool and draws are its own)."""

    sampler: Any
    kl_ctl: Any
    reward_stats: Any
    partial: Any = None
    placement: dict = field(default_factory=dict)  # {"world", "sequence_parallel_size", "rollout_ranks"}
    stream: Any = None  # rollout ranks apart: this trainer rank's stream (`RemoteRollout`), its next rows

    def save(self, root: Path, step: int, roles: dict, keep_last: int) -> Path:
        state = {
            "placement": self.placement,
            "sampler": self.sampler.state_dict(),
            "kl_ctl": self.kl_ctl.state_dict(),
            "reward_stats": self.reward_stats.state_dict(),
        }
        own = {}
        if self.partial is not None:
            own = {"partial": self.partial.state_dict(), "sampler": self.sampler.state_dict()}
        if self.stream is not None:
            own["stream"] = self.stream.state_dict()
        return save_checkpoint(root, step, roles, state, keep_last, rank_state=own or None)

    def load(self, path: Path, roles: dict) -> int:
        """The roles, this rank's RNG and the loop's state from checkpoint `path`; -> its step."""
        state = load_checkpoint(path, roles)
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.reward_stats.load_state_dict(state["reward_stats"])
        if self.partial is not None:
            if state["rank"] is None or "partial" not in state["rank"]:
                log.warning("resume: %s holds no partial rollouts (written without them): the pool starts empty", path)
            else:
                self.partial.load_state_dict(state["rank"]["partial"])
                self.sampler.load_state_dict(state["rank"]["sampler"])
        if self.stream is not None:  # the placement check made sure the checkpoint was written apart too
            self.stream.load_state_dict(state["rank"]["stream"])
        return int(state["step"])


def export_actor(engine, out_dir: Path, dtype: str, tokenizer, adapter: bool, run_dir: Path) -> None:
    """The actor as an HF model (safetensors) in `dtype`, or its LoRA adapter alone, written atomically;
    a write that fails ends the run in one line naming the last good checkpoint."""
    try:
        if adapter:
            export_adapter(engine, out_dir, tokenizer)
        else:
            export_hf(engine, out_dir, dtype, tokenizer)
    except OSError as e:
        raise RunFailure(f"exporting {out_dir} failed ({e}); {last_good(run_dir / 'checkpoints')}") from None
