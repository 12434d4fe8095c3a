"""`config render` is the dry run of `train`: what one refuses before any engine, the other refuses in the
same lines; and `trainer.sequence_parallel_size` is one switch: on any example it either renders (the
setup sets one-row micro-batches and the vLLM engine, and says so) or refuses with every reason at once."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocess_env import child_env
from verl_ds.cli import main
from verl_ds.data.tiny import build_chat_tokenizer, build_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
QUICK = ["logging.wandb.mode=disabled", "trainer.val_before_train=false"]


def errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def render(capsys, config, *overrides, world: int = 1, absent: bool = False) -> tuple[int, str, str]:
    capsys.readouterr()
    flags = ["--world-size", str(world), *(["--allow-absent"] if absent else [])]
    rc = main(["config", "render", "--config", str(config), *flags, *overrides])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def chat_teacher(tmp_path_factory):
    """A tiny model whose tokenizer is not the quickstart student's (ChatML characters, not digits)."""
    return build_tiny_llama(tmp_path_factory.mktemp("teacher"), build_chat_tokenizer(), hidden=32, ffn=64)


SP_HEADS = ["trainer.sequence_parallel_size=2", "model.tiny.heads=3", "model.tiny.hidden=96"]
BAD = {
    # (example, overrides, the refusal's keys): each refused before any engine
    "heads against the SP size": ("grpo_cpu_tiny", SP_HEADS, ["trainer.sequence_parallel_size"]),
    "SP's every reason at once": (
        "grpo_cpu_tiny",
        [*SP_HEADS, "rollout.engine=hf", "model.packing=true"],
        ["rollout.engine", "model.packing", "trainer.sequence_parallel_size"],
    ),
    "a teacher that is not here": ("opd_cpu_tiny", ["model.teacher_path=/nonexistent/teacher"], ["model.teacher_path"]),
    "a teacher with another tokenizer": ("opd_cpu_tiny", ["model.teacher_path={teacher}"], ["model.teacher_path"]),
    "HF rows past the positions": ("grpo_cpu_tiny", ["model.tiny.max_positions=16"], ["data.max_prompt_length"]),
    "vLLM context past the positions": (
        "grpo_cpu_tiny",
        ["rollout.engine=vllm", "rollout.max_model_len=300"],
        ["rollout.max_model_len"],
    ),
    "a data file that is not here": (
        "grpo_cpu_tiny",
        ["data.task=files", "data.train_files=[/nonexistent/train.jsonl]"],
        ["data.train_files[0]"],
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_render_refuses_what_train_refuses_in_the_same_lines(case, capsys, tmp_path, chat_teacher):
    example, overrides, keys = BAD[case]
    config = ROOT / "examples" / f"{example}.yaml"
    overrides = [o.format(teacher=chat_teacher) for o in overrides] + [f"trainer.run_dir={tmp_path}", *QUICK]
    sp = any(o.startswith("trainer.sequence_parallel_size") for o in overrides)
    rc, _, err = render(capsys, config, *overrides, world=2 if sp else 1)
    assert rc == 2 and sorted(line.split(":")[1].strip() for line in errors(err)) == sorted(keys), err
    if sp:  # two ranks' worth of config, refused before the process group: one process, a bounded wait
        env = {**child_env(), "WORLD_SIZE": "2", "RANK": "0"}
        cmd = [sys.executable, "-m", "verl_ds.cli", "train", "--config", str(config), *overrides]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
        train_rc, train_err = out.returncode, out.stderr
    else:
        train_rc = main(["train", "--config", str(config), *overrides])
        train_err = capsys.readouterr().err
    assert train_rc == 2 and errors(train_err) == errors(err), (err, train_err[-3000:])
    assert not (tmp_path / "checkpoints").exists()  # nothing of a run was made


def test_the_quickstart_with_sequence_parallelism_renders_and_says_what_it_set(capsys, tmp_path):
    rc, out, err = render(capsys, ROOT / "examples" / "grpo_cpu_tiny.yaml", "trainer.sequence_parallel_size=2", world=2)
    assert rc == 0, err
    assert "# rollout.engine auto -> vllm on this machine" in out  # the HF engine would run the split model
    said = next(line for line in out.splitlines() if line.startswith("# trainer.sequence_parallel_size 2:"))
    for key in ("roles.actor.micro_batch_size 64", "roles.actor.max_tokens_per_micro_batch 4096"):
        assert key in said, said
    assert '"train_micro_batch_size_per_gpu": 1' in out and '"train_micro_batch_size_per_gpu": 64' not in out


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_renders_as_it_is(example, capsys, monkeypatch):
    """From the repo root (the examples' relative paths); a model or data file not made yet listed."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # as a user's shell holds it
    rc, out, err = render(capsys, example, world=2, absent=True)
    assert rc == 0, err
    assert "# actor: DeepSpeed config" in out


FIXES = {  # what a user does about each SP refusal that names a key they set
    "rollout.engine": "rollout.engine=vllm",
    "model.packing": "model.packing=auto",
    "model.attn_implementation": "model.attn_implementation=auto",
}


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_sequence_parallelism_on_every_example_renders_or_refuses_every_reason_at_once(example, capsys, monkeypatch):
    """Adding `trainer.sequence_parallel_size=2` either renders, or refuses in one pass: fixing every key
    the refusal names brings no new refusal (a key the fixes cannot mend, the models' heads, may stay)."""
    monkeypatch.chdir(ROOT)  # the examples' relative paths
    sp = ["trainer.sequence_parallel_size=2"]
    rc, _, err = render(capsys, example, *sp, world=2, absent=True)
    if rc == 0:
        return
    first = {line.split(":")[1].strip() for line in errors(err)}
    assert rc == 2 and first, err
    fixes = [FIXES[k] for k in first if k in FIXES]
    rc, _, err2 = render(capsys, example, *sp, *fixes, world=2, absent=True)
    second = {line.split(":")[1].strip() for line in errors(err2)}
    assert rc == 0 or second <= first - set(FIXES), (err, err2)
