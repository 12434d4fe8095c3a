"""A user's reward function at run time: anything but a finite number is one line naming the function,
what it gave and where, exit 2, before a step trains on it."""

import subprocess

import pytest
import torch

from tests.data import user_rewards
from tests.e2e.helpers import ROOT, train_cmd
from verl_ds.data.reward import call_reward
from verl_ds.errors import ConfigError

FILE = user_rewards.__file__


@pytest.mark.parametrize(
    "fn, said",
    [
        (user_rewards.returns_none, "returned None (NoneType)"),
        (user_rewards.returns_text, "returned '1.0' (str)"),
        (user_rewards.returns_nan, "returned nan (float)"),
        (user_rewards.raises, "raised KeyError: 'missing' (at " + FILE + ":"),
    ],
)
def test_a_reward_that_breaks_the_contract_is_one_line_naming_the_function_and_where(fn, said):
    with pytest.raises(ConfigError) as e:
        call_reward(fn, "2", "2")
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"data.reward_fn: tests.data.user_rewards:{fn.__name__}")
    assert said in line and FILE in line


def test_numbers_of_every_kind_keep_their_value():
    assert call_reward(user_rewards.returns_bool, "2", "2") == 1.0
    assert call_reward(lambda r, a: 3, "", "") == 3.0
    assert call_reward(lambda r, a: torch.tensor(0.5), "", "") == 0.5
    with pytest.raises(ConfigError):
        call_reward(lambda r, a: float("inf"), "", "")


def test_a_reward_function_returning_none_stops_train_in_one_line_before_a_step(tmp_path):
    cmd, env = train_cmd(
        "grpo_cpu_tiny.yaml",
        tmp_path / "run",
        "data.reward_fn=tests.data.user_rewards:returns_none",
        "trainer.steps=2",
        "logging.wandb.mode=disabled",
        ranks=1,
    )
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    errors = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "tests.data.user_rewards:returns_none" in errors[0], out.stderr[-2000:]
    assert "returned None (NoneType)" in errors[0] and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()
