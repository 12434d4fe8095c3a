"""On-policy distillation in the loop (one process, HF rollout, real DeepSpeed engines): the teacher
role, the reverse KL as a dense reward or a loss term, and the start-up tokenizer check."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.subprocess_env import child_env
from verl_ds.config import load_config
from verl_ds.data.tiny import build_chat_tokenizer, build_tiny_llama
from verl_ds.roles.base import RoleObserver
from verl_ds.trainer.rl_trainer import RLTrainer

FP32 = [f"precision.{k}_dtype=fp32" for k in ("actor", "teacher", "rollout", "buffer")]
SHAPE = dict(hidden=32, layers=2, heads=2, ffn=64)


def sharp_teacher(path, seed: int = 1, scale: float = 10.0, **shape) -> str:
    """A random tiny Llama whose final norm is scaled: peaked next-token distributions, far from the
    near-uniform random student (a reverse KL of ~2 nats to start from)."""
    out = build_tiny_llama(path, **(shape or SHAPE), seed=seed)
    f = out / "model.safetensors"
    sd = load_file(str(f))
    sd["model.norm.weight"] = sd["model.norm.weight"] * scale
    save_file(sd, str(f), metadata={"format": "pt"})
    return str(out)


def distill_config(tmp_path, student, teacher, *extra):
    return load_config(
        None,
        [
            "rollout.engine=hf",
            "trainer.prompts_per_step=4",
            "rollout.n=4",
            "rollout.max_new_tokens=8",
            *FP32,
            f"model.path={student}",
            f"model.teacher_path={teacher}",
            "algorithm.distill.coef=1.0",
            "algorithm.kl_coef=0",
            f"trainer.run_dir={tmp_path / 'run'}",
            "logging.wandb.mode=disabled",
            "roles.actor.lr=1e-2",
            "roles.actor.zero_stage=0",
            "roles.actor.micro_batch_size=8",
            "roles.teacher.micro_batch_size=8",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return str(build_tiny_llama(tmp_path_factory.mktemp("student") / "model", **SHAPE, seed=0))


class Grads(RoleObserver):
    """The actor's reduced gradients just before its first optimizer step."""

    def __init__(self):
        self.first = None

    def on_step(self, role):
        if self.first is None:
            self.first = {str(i): g.detach().clone() for i, g in enumerate(role.grad_partitions())}


@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["reward", "loss"])
def test_a_teacher_equal_to_the_student_gives_exactly_zero(tmp_path, student, mode):
    """fp32, the teacher = the student's initial weights: the reverse KL, the distillation
    advantages (reward mode) and the loss term (loss mode) are exactly 0 at the first step."""
    seen = {}

    from verl_ds.diagnostics.observers import TrainerObserver

    class Spy(TrainerObserver):
        def on_train_batch(self, trainer, train):
            seen["adv"], seen["teacher"] = train.advantages.clone(), train.teacher_logprobs.clone()

    cfg = distill_config(tmp_path, student, student, f"algorithm.distill.mode={mode}")
    with RLTrainer(cfg) as trainer:
        trainer.observers.append(Spy())
        m = trainer.step()
    assert m["distill/reverse_kl/mean"] == 0.0
    assert m["distill/teacher_logprob/mean"] < 0  # the teacher did score the samples
    assert torch.count_nonzero(seen["adv"]) == 0
    if mode == "loss":
        assert m["actor/distill_loss"] == 0.0
    assert m["actor/grad_norm"] == 0.0  # nothing to learn from a teacher that is the student


def test_the_reverse_kl_to_a_different_teacher_falls(tmp_path, student):
    """Distillation alone (no task reward) moves the student toward a peaked teacher: the per-token
    reverse KL on the student's own samples falls over a few steps."""
    cfg = distill_config(tmp_path, student, sharp_teacher(tmp_path / "teacher"), "trainer.steps=14")
    with RLTrainer(cfg) as trainer:
        kl = [trainer.step()["distill/reverse_kl/mean"] for _ in range(14)]
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert first > 1.0, kl  # the teacher is far from the random student
    assert last < 0.75 * first, kl


@pytest.mark.numerics
def test_the_reward_mode_and_the_k2_loss_take_the_same_on_policy_gradient(tmp_path, student):
    """On the student's own samples, r_t = -(log pi_s - log pi_t) as each token's advantage and the
    k2 loss 0.5 (log pi_s - log pi_t)^2 have the same gradient, (log pi_s - log pi_t) grad log pi_s:
    the two modes' first gradients agree up to summation order."""
    teacher = sharp_teacher(tmp_path / "teacher")
    grads = {}
    for mode in ("reward", "loss"):
        cfg = distill_config(tmp_path / mode, student, teacher, f"algorithm.distill.mode={mode}")
        with RLTrainer(cfg) as trainer:
            spy = Grads()
            trainer.actor.observers.append(spy)
            trainer.step()
        grads[mode] = spy.first
    from tests.roles.helpers import assert_same_gradients

    assert_same_gradients(grads["loss"], grads["reward"])


def test_a_teacher_with_another_tokenizer_is_one_line_and_exit_2(tmp_path, student):
    other = build_tiny_llama(tmp_path / "other", build_chat_tokenizer(), **SHAPE)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"model: {{path: {student}, teacher_path: {other}}}\n"
        "algorithm: {distill: {coef: 1.0}, kl_coef: 0}\n"
        f"trainer: {{run_dir: {tmp_path / 'run'}}}\nlogging: {{wandb: {{mode: disabled}}}}\n"
        "rollout: {engine: hf}\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "verl_ds.cli", "train", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [x for x in out.stderr.splitlines() if "error:" in x]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "model.teacher_path" in lines[0] and "at id 1 (student '<bos>', teacher '<unk>')" in lines[0], lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_debug_precision_measures_and_advises_the_teacher(tmp_path, student, capsys, dtype):
    """`verl-ds debug precision` probes the teacher as a role of its own: a row per dtype (an int8
    teacher measured from its fp32 checkpoint) and a recommendation in the precision: block."""
    from verl_ds import cli

    args = ["debug", "precision", "--config", "examples/opd_cpu_tiny.yaml", "--steps", "1", "--out", str(tmp_path)]
    overrides = [
        f"model.path={student}",
        f"model.teacher_path={sharp_teacher(tmp_path / 'teacher')}",
        f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.prompts_per_step=4",
        "rollout.n=4",
        "rollout.engine=hf",
        "roles.actor.micro_batch_size=16",
        *FP32,
        f"precision.teacher_dtype={dtype}",
    ]
    assert cli.main(args + overrides) == 0
    text = capsys.readouterr().out
    for dt in ("fp32", "bf16", "fp16"):
        assert f"| teacher | {dt} |" in text, text
    advice = text.split("### Recommendations", 1)[1]
    assert f"- teacher: {dtype}" in advice, advice
    assert f"teacher_dtype: {dtype}" in (tmp_path / "precision.yaml").read_text()
