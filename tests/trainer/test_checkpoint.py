"""Checkpoints and HF exports are swapped in by renames (`roles.params.swap_in`): a reader sees the
old directory or the new one, never a partial one; rotation keeps the last `keep_last`."""

import json
from pathlib import Path

from verl_ds.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from verl_ds.roles.params import swap_in, write_dir_atomically


class FakeRole:
    def __init__(self):
        self.loaded = None

    def save(self, ckpt_dir: str, tag: str) -> None:
        Path(ckpt_dir).mkdir(parents=True)
        (Path(ckpt_dir) / f"{tag}.bin").write_text("w")

    def load(self, ckpt_dir: str, tag: str) -> None:
        self.loaded = (ckpt_dir, tag)


def test_swap_in_replaces_a_directory_and_leaves_no_tmp_or_old(tmp_path):
    final, tmp = tmp_path / "out", tmp_path / "out.tmp"
    final.mkdir()
    (final / "a").write_text("old")
    tmp.mkdir()
    (tmp / "b").write_text("new")
    assert swap_in(tmp, final) == final
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_write_dir_atomically(tmp_path):
    out = write_dir_atomically(tmp_path / "hf", lambda t: (t.mkdir(), (t / "config.json").write_text("{}")))
    out = write_dir_atomically(out, lambda t: (t.mkdir(), (t / "model.safetensors").write_text("")))
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_save_checkpoint_swaps_in_rotates_and_loads(tmp_path):
    roles = {"actor": FakeRole()}
    for step in (1, 2, 3, 3):  # step 3 twice: the second replaces the first
        save_checkpoint(tmp_path, step, roles, {"sampler": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]  # no .tmp / .old left
    assert json.loads((tmp_path / "step_3" / "trainer_state.json").read_text()) == {"step": 3, "sampler": 3}
    state = load_checkpoint(tmp_path / "step_3", roles)
    assert state["step"] == 3 and roles["actor"].loaded == (str(tmp_path / "step_3" / "actor"), "ds")


# ---------------------------------------------------------------------- damaged checkpoints (real ones)
def _tiny_run_with_two_checkpoints(run_dir: Path) -> list[Path]:
    from verl_ds.config import load_config
    from verl_ds.trainer.rl_trainer import RLTrainer

    cfg = load_config(
        None,
        [
            "rollout.engine=hf",
            "trainer.steps=2",
            "trainer.prompts_per_step=4",
            "rollout.n=2",
            "trainer.val_every=0",
            "trainer.val_before_train=false",
            "checkpoint.every=1",
            "checkpoint.keep_last=2",
            *[f"precision.{k}_dtype=fp32" for k in ("actor", "reference", "rollout", "buffer")],
            f"trainer.run_dir={run_dir}",
            "logging.wandb.mode=disabled",
            "model.tiny.hidden=32",
            "model.tiny.ffn=64",
        ],
    )
    with RLTrainer(cfg) as trainer:
        trainer.fit()
    return list_checkpoints(run_dir / "checkpoints")


def _cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_damaged_checkpoint_is_named_and_auto_resumes_from_the_newest_intact_one(tmp_path, caplog):
    """A real checkpoint, then damaged as a full disk or a cut copy leaves it: its largest DeepSpeed
    state file cut in half, then trainer_state.json cut short. `damage` names the file; `resume: auto`
    passes over the damaged step_2 to step_1 in one log line, and starts fresh when none is intact; an
    explicit path is a ConfigError naming what is wrong."""
    import pytest

    from verl_ds.checkpoint import damage, pick_resume
    from verl_ds.errors import ConfigError

    root = tmp_path / "checkpoints"
    step1, step2 = _tiny_run_with_two_checkpoints(tmp_path)
    assert damage(step1, ["actor"], 1) is None and damage(step2, ["actor"], 1) is None
    # another world: one line, not passed over to a fresh start (every checkpoint of the run has its world)
    assert json.loads((step2 / "trainer_state.json").read_text())["placement"] == {
        "world": 1,
        "sequence_parallel_size": 1,
        "rollout_ranks": 0,
    }
    for resume in ("auto", str(step2)):
        with pytest.raises(ConfigError, match=r"was written by 1 ranks and this run has 2: .* resume it on 1 ranks"):
            pick_resume(root, resume, ["actor"], 2, sp=2)
    states = max((step2 / "actor").rglob("*.pt"), key=lambda p: p.stat().st_size)
    _cut_in_half(states)
    assert damage(step2, ["actor"], 1).startswith(f"{states.relative_to(step2)} is not a whole torch file")
    with caplog.at_level("WARNING"):
        assert pick_resume(root, "auto", ["actor"], 1) == step1
    assert f"resume: auto passes over {step2}" in caplog.text
    with pytest.raises(ConfigError, match=r"is not a usable verl-ds checkpoint: actor/.* is not a whole torch file"):
        pick_resume(root, str(step2), ["actor"], 1)
    _cut_in_half(step1 / "trainer_state.json")
    assert pick_resume(root, "auto", ["actor"], 1) is None
    assert damage(step1, ["actor"], 1).startswith("trainer_state.json does not parse")
    assert damage(step1, ["actor", "critic"], 2) == "missing rng_rank1.pt, critic"
    assert pick_resume(root, "none", ["actor"], 1) is None


def test_resuming_a_damaged_checkpoint_is_one_line_before_any_engine_is_built(tmp_path):
    """Through the CLI: exit 2, one line naming the file, and no engine was built (no DeepSpeed
    start-up output, no vLLM) before it."""
    from tests.subprocess_env import run_cli

    step1, _ = _tiny_run_with_two_checkpoints(tmp_path)
    _cut_in_half(step1 / "rng_rank0.pt")
    root = Path(__file__).resolve().parents[2]
    config = str(root / "examples" / "grpo_cpu_tiny.yaml")
    args = [f"trainer.resume={step1}", f"trainer.run_dir={tmp_path / 'again'}", "logging.wandb.mode=disabled"]
    out = run_cli("train", "--config", config, *args, "rollout.engine=hf", cwd=root)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: trainer.resume: {step1} is not a usable verl-ds checkpoint: rng_rank0.pt is not a "
        "whole torch file (File is not a zip file)"
    ], out.stderr
    assert "Traceback" not in out.stderr and "DeepSpeed info" not in out.stdout + out.stderr


def test_a_run_directory_that_cannot_be_written_is_one_line_before_any_work(tmp_path):
    """A read-only run directory: the probe at start says so (the key and the path), instead of a
    PermissionError when the first checkpoint is written after a step trained."""
    import os

    import pytest

    from verl_ds.checkpoint import probe_writable
    from verl_ds.errors import ConfigError

    ro = tmp_path / "ro"
    ro.mkdir()
    probe_writable(tmp_path / "rw" / "checkpoints", "trainer.run_dir")
    assert not (tmp_path / "rw").exists()  # the probe leaves nothing, not even the folders
    (tmp_path / "rw").mkdir()
    probe_writable(tmp_path / "rw", "trainer.run_dir")
    assert list((tmp_path / "rw").iterdir()) == []
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):  # root writes anywhere: make the path a file's child instead
            (tmp_path / "a_file").write_text("")
            ro = tmp_path / "a_file"
        with pytest.raises(ConfigError, match=r"^trainer.run_dir: .* is not writable"):
            probe_writable(ro / "checkpoints", "trainer.run_dir")
    finally:
        os.chmod(tmp_path / "ro", 0o700)


def test_a_checkpoint_write_that_fails_mid_run_keeps_the_last_good_one_and_says_where(tmp_path):
    """Lost work: step 2's checkpoint cannot be written (its temporary directory's name is taken by
    a file, as a full disk or a path made read-only would fail it). The run ends in one line that
    names the newest good checkpoint, step_1, which is intact and what `resume: auto` picks."""
    from tests.subprocess_env import run_cli
    from verl_ds.checkpoint import damage, pick_resume

    root = Path(__file__).resolve().parents[2]
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / ".step_2.tmp").write_text("in the way")
    args = [
        "trainer.steps=2",
        "trainer.prompts_per_step=4",
        "rollout.n=2",
        "roles.actor.micro_batch_size=8",
        "roles.reference.micro_batch_size=8",
        "checkpoint.every=1",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        f"trainer.run_dir={tmp_path}",
        "logging.wandb.mode=disabled",
        "rollout.engine=hf",
    ]
    out = run_cli("train", "--config", str(root / "examples" / "grpo_cpu_tiny.yaml"), *args, cwd=root)
    assert out.returncode == 1, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: writing checkpoint step_2 failed ("), out.stderr
    assert errors[0].endswith(
        f"the last good checkpoint is {ckpts / 'step_1'} (trainer.resume: auto continues from it)"
    )
    assert "Traceback" not in out.stderr
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_1"]
    assert damage(ckpts / "step_1", ["actor"], 1) is None
    assert pick_resume(ckpts, "auto", ["actor"], 1) == ckpts / "step_1"
