"""Checkpoints and HF exports are swapped in by renames (`roles.params.swap_in`): a reader sees the
old directory or the new one, never a partial one; rotation keeps the last `keep_last`."""

import json
from pathlib import Path

from verl_ds.roles.params import swap_in, write_dir_atomically
from verl_ds.trainer.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint


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
