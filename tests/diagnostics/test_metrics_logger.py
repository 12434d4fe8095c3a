"""metrics.jsonl across runs in one run dir (wandb disabled: the file is what is tested)."""

import json
from types import SimpleNamespace

from verl_ds.diagnostics.metrics import MetricsLogger

OFF = SimpleNamespace(mode="disabled")


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_fresh_run_starts_a_new_file_and_resume_drops_replayed_steps(tmp_path):
    first = MetricsLogger(tmp_path, OFF, {}, -1)
    for step in range(5):
        first.log({"x": float(step)}, step)
    first.finish()

    resumed = MetricsLogger(tmp_path, OFF, {}, 2)  # checkpoint at step 2: steps 3-4 are replayed
    resumed.log({"x": 3.0}, 3)
    resumed.finish()
    assert _steps(tmp_path / "metrics.jsonl") == [0, 1, 2, 3]

    fresh = MetricsLogger(tmp_path, OFF, {}, -1)  # no checkpoint: nothing of the old run stays
    fresh.log({"x": 0.0}, 0)
    fresh.finish()
    assert _steps(tmp_path / "metrics.jsonl") == [0]
    assert not list(tmp_path.glob(".*.tmp"))
