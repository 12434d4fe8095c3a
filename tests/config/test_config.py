"""Run config, PrecisionConfig rendering, and the one-line exit-2 errors for bad input."""

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.subprocess_env import child_env, run_cli
from verl_ds.cli import main
from verl_ds.config import load_config
from verl_ds.ds_config import render_ds_configs
from verl_ds.errors import ConfigError
from verl_ds.precision import Hardware, PrecisionConfig, auto_compute_dtype, resolve_precision

ROOT = Path(__file__).resolve().parents[2]
CPU_GRPO = ROOT / "examples" / "grpo_cpu_tiny.yaml"
CPU_PPO = ROOT / "examples" / "ppo_cpu_tiny.yaml"


def cli(*args, cwd=ROOT):
    return run_cli(*args, cwd=cwd)


def test_examples_load_and_render_with_every_role(monkeypatch):
    # as a user's shell holds it: an in-process run earlier in the session set it to 1 (dist.init_distributed)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(CPU_PPO)
    assert cfg.algorithm.estimator == "gae"
    rendered = render_ds_configs(cfg, world_size=2)
    assert set(rendered) == {"actor", "critic", "reference"}
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        load_config(path)  # every shipped example is valid


def test_render_cli_prints_every_role_accepted_by_deepspeed(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text("{}")
    out = cli(
        "config",
        *("render", "--config", str(CPU_PPO), f"model.reward_path={rm}", "model.teacher_path=t"),
        *("algorithm.distill.coef=1", "algorithm.estimator=grpo", "precision.teacher_dtype=bf16", "--world-size", "1"),
        "--allow-absent",
    )
    assert out.returncode == 0, out.stderr
    blocks = [b for b in out.stdout.split("\n# ") if ": DeepSpeed config" in b.split("\n")[0]]
    roles = [b.split(":")[0] for b in blocks]
    assert roles == ["actor", "reference", "reward", "teacher"]  # grpo: no critic
    assert json.loads(blocks[-1].split("\n", 1)[1])["bf16"] == {"enabled": True}  # the teacher's own precision
    for b in blocks:
        ds = json.loads(b.split("\n", 1)[1])
        DeepSpeedConfig(ds)  # DeepSpeed's own parser accepts it (raises otherwise)
        assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds.get("gradient_accumulation_steps", 1)


def test_fp16_override_yields_dynamic_loss_scale_block_and_no_bf16():
    cfg = load_config(CPU_GRPO, ["precision.actor_dtype=fp16"])
    actor = render_ds_configs(cfg, world_size=1)["actor"]
    assert "bf16" not in actor
    fp16 = actor["fp16"]
    assert fp16["enabled"] is True and fp16["loss_scale"] == 0 and fp16["initial_scale_power"] == 11
    for key in ("loss_scale_window", "hysteresis", "consecutive_hysteresis", "min_loss_scale"):
        assert key in fp16
    assert actor["communication_data_type"] == "fp32"  # fp16 roles reduce grads in fp32 by default


def test_bf16_grad_accum_and_comm_dtype_and_clipping():
    cfg = load_config(
        CPU_GRPO,
        [
            "precision.actor_dtype=bf16",
            "precision.grad_accum_dtype=fp32",
            "precision.actor_comm_dtype=bf16",
            "trainer.max_grad_norm=0.5",
        ],
    )
    actor = render_ds_configs(cfg, world_size=1)["actor"]
    assert actor["bf16"] == {"enabled": True} and "fp16" not in actor
    assert actor["data_types"]["grad_accum_dtype"] == "fp32"
    assert actor["communication_data_type"] == "bf16"
    assert actor["gradient_clipping"] == 0.5


def test_batch_sizes_filled_from_run_config():
    cfg = load_config(
        CPU_GRPO,
        ["trainer.prompts_per_step=8", "rollout.n=8", "trainer.mini_batch_size=32", "roles.actor.micro_batch_size=4"],
    )
    actor = render_ds_configs(cfg, world_size=2)["actor"]
    assert (
        actor["train_batch_size"],
        actor["train_micro_batch_size_per_gpu"],
        actor["gradient_accumulation_steps"],
    ) == (32, 4, 4)
    assert actor["optimizer"]["params"]["lr"] == cfg.roles.actor.lr


AVX2 = Hardware("cpu", cpu_flags=frozenset({"avx2", "fma"}))
AVX512_BF16 = Hardware("cpu", cpu_flags=frozenset({"avx2", "avx512f", "avx512_bf16"}))
AMX = Hardware("cpu", cpu_flags=frozenset({"amx_bf16", "amx_tile"}))
A100 = Hardware("cuda", cuda_capability=(8, 0))
V100 = Hardware("cuda", cuda_capability=(7, 0))


@pytest.mark.parametrize(
    "hw,want", [(AVX2, "fp32"), (AVX512_BF16, "bf16"), (AMX, "bf16"), (A100, "bf16"), (V100, "fp16")]
)
def test_auto_rule_every_branch_from_injected_hardware(hw, want):
    assert auto_compute_dtype(hw)[0] == want
    r = resolve_precision(PrecisionConfig(), hw)
    assert (r.actor, r.critic, r.reference, r.reward, r.rollout) == (want,) * 5
    assert r.actor_comm == ("fp32" if want == "fp16" else None)  # fp16 grads reduce in fp32


def test_batch_invariant_kernels_resolve_on_a_gpu_only_and_say_the_cpu_no_op(caplog):
    """`precision.batch_invariant` turns vLLM's batch-invariant kernels on in a GPU process (the builder and
    a rollout rank call `vllm_internals.batch_invariant_kernels` when the resolved flag is set); on a CPU it is
    resolved off and said once, so nothing GPU-only is called there."""
    asked = PrecisionConfig(batch_invariant=True)
    assert resolve_precision(asked, A100).batch_invariant
    assert not resolve_precision(PrecisionConfig(), A100).batch_invariant
    with caplog.at_level(logging.INFO, logger="verl_ds.precision"):
        assert not resolve_precision(asked, AVX512_BF16).batch_invariant
    assert "precision.batch_invariant: a no-op on CPU" in caplog.text


def test_forced_avx2_kernels_resolve_auto_as_an_avx2_host():
    """Under `ATEN_CPU_CAPABILITY=avx2` (launch/numerics_avx2.sh) bf16 is emulated whatever the CPU
    has, so this machine's `auto` is fp32 and its bf16 flags do not count, as on an AVX2-only host."""
    probe = (
        "from verl_ds.precision import auto_compute_dtype, detect_hardware; hw = detect_hardware('cpu'); "
        "print(auto_compute_dtype(hw)[0], hw.cpu_bf16, sorted(hw.cpu_flags & {'avx512_bf16', 'amx_bf16'}))"
    )
    env = child_env(ATEN_CPU_CAPABILITY="avx2")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["fp32", "False", "[]"], out.stdout + out.stderr


def test_token_budgets_are_on_by_default_and_never_exceed_a_full_length_row_micro_batch():
    """`max_tokens_per_micro_batch: auto` (the default) is micro_batch_size x the longest row the run
    can make: a prompt cut at max_prompt_length plus a full response (multi-turn: up to its token
    cap), never past max_model_len. An explicit number wins; 0 is row micro-batches."""
    from verl_ds.config import token_budget

    lengths = ["data.max_prompt_length=40", "rollout.max_new_tokens=24"]
    cfg = load_config(None, [*lengths, "roles.actor.micro_batch_size=4"])
    assert cfg.roles.actor.max_tokens_per_micro_batch == cfg.roles.critic.max_tokens_per_micro_batch == "auto"
    assert token_budget(cfg, "actor") == 4 * (40 + 24)
    assert token_budget(cfg, "reference") == cfg.roles.reference.micro_batch_size * (40 + 24)
    mt = ["rollout.multi_turn.env=retry", "rollout.max_model_len=200", "data.max_prompt_length=40"]
    assert token_budget(load_config(None, mt), "critic") == cfg.roles.critic.micro_batch_size * 200
    capped = load_config(None, [*mt, "rollout.multi_turn.max_total_tokens=100"])
    assert token_budget(capped, "critic") == cfg.roles.critic.micro_batch_size * 140
    for explicit in (0, 512):
        cfg = load_config(None, [f"roles.actor.max_tokens_per_micro_batch={explicit}"])
        assert token_budget(cfg, "actor") == explicit


def test_resolution_explicit_wins_then_json_then_hardware():
    p = PrecisionConfig(
        actor_dtype="fp32",
        critic_dtype="auto",
        reference_dtype="auto",
        rollout_dtype="auto",
        buffer_dtype="auto",
        reward_dtype="int8",
    )
    r = resolve_precision(p, AVX512_BF16, json_dtypes={"critic": "fp16"})
    assert (r.actor, r.critic, r.reference, r.buffer, r.reward) == ("fp32", "fp16", "bf16", "bf16", "int8")
    assert r.rollout == "fp32"  # an auto rollout follows the actor: same numbers both sides
    with pytest.raises(dataclasses.FrozenInstanceError):  # immutable: nothing downstream re-decides
        r.actor = "bf16"


def test_rendered_configs_follow_injected_hardware_not_this_machine():
    from verl_ds.ds_config import run_precision

    cfg = load_config(CPU_GRPO, ["precision.actor_dtype=auto"])
    for hw, block in ((AVX2, None), (AVX512_BF16, "bf16"), (V100, "fp16")):
        actor = render_ds_configs(cfg, 1, run_precision(cfg, hw))["actor"]
        assert ("bf16" in actor, "fp16" in actor) == (block == "bf16", block == "fp16")


def test_python_precision_config_validates():
    with pytest.raises(ConfigError, match="precision.actor_dtype"):
        PrecisionConfig(actor_dtype="int8")
    with pytest.raises(ConfigError, match="unknown dtype"):
        PrecisionConfig(critic_dtype="fp8")
    assert PrecisionConfig(reward_dtype="int8").reward_dtype == "int8"


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


BAD_INPUTS = {
    "yaml_syntax": ("trainer: {steps: 3\n", [], "YAML syntax error"),
    "unknown_key": ("trainer:\n  stepz: 3\n", [], "did you mean 'trainer.steps'"),
    "wrong_type": ("trainer:\n  steps: many\n", [], "trainer.steps: expected int"),
    "missing_json": (
        "roles:\n  actor: {ds_config: nope.json}\n",
        [],
        "roles.actor.ds_config: DeepSpeed config file not found",
    ),
    "malformed_json": ("roles:\n  actor: {ds_config: BADJSON}\n", [], "malformed JSON"),
    "fp16_and_bf16": ("roles:\n  actor: {ds_config: BOTHJSON}\n", [], "fp16 and bf16 are both enabled"),
    "int8_trained": ("precision: {actor_dtype: int8}\n", [], "int8 is only supported for the reward model"),
    "bf16_fp32_accum_stage0": (
        "roles:\n  actor: {ds_config: STAGE0}\nprecision: {actor_dtype: bf16, grad_accum_dtype: fp32}\n",
        [],
        "ZeRO stage 0",
    ),
    "unknown_dtype": ("precision: {critic_dtype: fp8}\n", [], "unknown dtype 'fp8'"),
    "block_size": (
        "rollout: {block_size: 16}\n",
        [],
        "rollout.block_size: must be 0 (vLLM's default) or a multiple of 32",
    ),
    "batch_not_divisible": (
        "trainer: {prompts_per_step: 3}\nrollout: {n: 4}\n",
        ["roles.actor.micro_batch_size=5"],
        "not divisible",
    ),
    "bad_override": ("{}\n", ["trainer.steps=abc"], "trainer.steps: expected int"),
    "bad_float": ("{}\n", ["roles.actor.lr=fast"], "roles.actor.lr: expected float"),
    "zero_temperature": ("rollout: {temperature: 0}\n", [], "rollout.temperature: must be > 0"),
    "kl_target_with_kl_loss": ("algorithm: {kl_target: 0.1, use_kl_loss: true}\n", [], "algorithm.kl_target"),
    "tools_without_tool_env": (
        "data: {tools: [calculator]}\n",
        [],
        "data.tools: tools are called through the tool environment",
    ),
    "tool_env_without_tools": (
        "rollout: {multi_turn: {env: tools}}\n",
        [],
        "data.tools: rollout.multi_turn.env: tools needs",
    ),
    "tokenization_check": (
        "rollout: {multi_turn: {tokenization_check: loose}}\n",
        [],
        "rollout.multi_turn.tokenization_check: 'loose' is not one of strict, off",
    ),
    "max_turns_zero": (
        "rollout: {multi_turn: {env: retry, max_turns: 0}}\n",
        [],
        "rollout.multi_turn.max_turns: must be > 0",
    ),
    "few_shot_shape": (
        "data: {apply_chat_template: true, few_shot: [{role: user}]}\n",
        [],
        "data.few_shot[0]: expected",
    ),
    "agent_path": (
        "rollout: {multi_turn: {agent: tests.e2e.no_such_module:agent}}\ndata: {apply_chat_template: true}\n",
        [],
        "rollout.multi_turn.agent: cannot import module 'tests.e2e.no_such_module'",
    ),
    "agent_not_async": (
        "rollout: {multi_turn: {agent: tests.e2e.helpers:length_reward}}\ndata: {apply_chat_template: true}\n",
        [],
        "rollout.multi_turn.agent: length_reward is not an `async def agent(client, example)` function",
    ),
    "openenv_unreachable": (
        "rollout: {multi_turn: {env: openenv, env_kwargs: {base_url: 'http://127.0.0.1:1'}}}\n",
        [],
        "rollout.multi_turn.env_kwargs.base_url: http://127.0.0.1:1: nothing answers there",
    ),
    "partial_without_correction": (
        "rollout: {partial: {enabled: true}}\n",
        [],
        "algorithm.tis_cap: partial rollouts train tokens sampled by older weights",
    ),
    "overlong_multi_turn": (
        "rollout: {max_new_tokens: 8, multi_turn: {env: retry}}\nalgorithm: {overlong: {buffer_len: 4}}\n",
        [],
        "algorithm.overlong.buffer_len: the overlong penalty measures one response",
    ),
    "system_prompt_without_template": ("data: {system_prompt: hi}\n", [], "data.system_prompt: a system prompt needs"),
    "explicit_train_batch": ("roles:\n  actor: {ds_config: TBS}\n", [], "train_batch_size 7 != the run's mini-batch"),
    "frozen_role_zero2": ("roles:\n  reference: {ds_config: STAGE2}\n", [], "inference-only"),
    "max_model_len": (
        "rollout: {max_model_len: 16, max_new_tokens: 8}\ndata: {max_prompt_length: 12}\n",
        [],
        "rollout.max_model_len: 16 < data.max_prompt_length 12 + rollout.max_new_tokens 8",
    ),
    "grpo_single_sample": ("algorithm: {estimator: grpo}\nrollout: {n: 1}\n", [], "rollout.n: estimator 'grpo'"),
    "tp_not_dividing": ("rollout: {tensor_parallel_size: 3}\n", ["--world-size", "2"], "rollout.tensor_parallel_size"),
    "micro_batch_zero": ("roles:\n  actor: {micro_batch_size: 0}\n", [], "roles.actor.micro_batch_size"),
    "max_tokens_negative": (
        "roles:\n  critic: {max_tokens_per_micro_batch: -1}\n",
        [],
        "roles.critic.max_tokens_per_micro_batch",
    ),
    "max_tokens_not_auto": (
        "roles:\n  actor: {max_tokens_per_micro_batch: lots}\n",
        [],
        "roles.actor.max_tokens_per_micro_batch: must be auto or an integer, got 'lots'",
    ),
    # nothing silently accepted: a key written twice (YAML and JSON keep the last), an empty file
    "yaml_section_twice": (
        "trainer:\n  run_dir: runs/mine\nrollout: {n: 4}\ntrainer:\n  steps: 3\n",
        [],
        "key 'trainer' is given twice (lines 1 and 4)",
    ),
    "yaml_key_twice_in_a_section": ("rollout:\n  n: 4\n  n: 8\n", [], "run.yaml:3: key 'n' is given twice"),
    "empty_yaml": ("", [], "the config file is empty"),
    "json_key_twice": ("roles:\n  actor: {ds_config: TWICEJSON}\n", [], "key 'zero_optimization' is given twice"),
    "model_without_config": ("model: {path: EMPTYDIR}\n", [], "has no config.json"),
    "model_without_tokenizer": ("model: {path: NOTOKDIR}\n", [], "has no tokenizer"),
    # out-of-range values: bounds at the field
    "negative_lr": ("{}\n", ["roles.actor.lr=-1e-5"], "roles.actor.lr: must be >= 0, got -1e-05"),
    "gamma_above_one": ("algorithm: {gamma: 1.5}\n", [], "algorithm.gamma: must be <= 1, got 1.5"),
    "top_p_zero": ("rollout: {top_p: 0}\n", [], "rollout.top_p: must be > 0, got 0"),
    "keep_last_negative": ("checkpoint: {keep_last: -1}\n", [], "checkpoint.keep_last: must be >= 0, got -1"),
    "zero_stage_in_yaml": ("roles:\n  actor: {zero_stage: 4}\n", [], "roles.actor.zero_stage: '4' is not one of"),
    "zero_stage_in_json": (
        "roles:\n  actor: {ds_config: STAGE5}\n",
        [],
        "zero_optimization.stage must be 0, 1, 2 or 3",
    ),
    "micro_batch_in_json": ("roles:\n  actor: {ds_config: MICRO0}\n", [], "train_micro_batch_size_per_gpu must be"),
    "loss_scale_window": (
        "precision: {actor_loss_scaling: {loss_scale_window: 0}}\n",
        [],
        "precision.actor_loss_scaling.loss_scale_window: must be > 0",
    ),
    "scale_power_overflows": (
        "precision: {actor_loss_scaling: {initial_scale_power: 400}}\n",
        [],
        "precision.actor_loss_scaling.initial_scale_power: must be <= 127, got 400",
    ),
    "min_scale_above_start": (
        "precision: {critic_loss_scaling: {initial_scale_power: 2, min_loss_scale: 8}}\n",
        [],
        "precision.critic_loss_scaling.min_loss_scale: 8.0 is above the starting scale 2**2",
    ),
    # damaged model files, named before anything loads them
    "model_config_malformed": ("model: {path: BADCFGDIR}\n", [], "config.json: malformed JSON at line 1"),
    "model_weights_cut_short": ("model: {path: CUTDIR}\n", [], "model.safetensors: cut short"),
    "model_weights_not_safetensors": ("model: {path: NOTSTDIR}\n", [], "model.safetensors: not a safetensors file"),
    # names a run resolves at start, resolved by validation (so `config render` catches them)
    "unknown_reward_fn": ("data: {reward_fn: no_such_reward}\n", [], "data.reward_fn"),
    "unknown_env": (
        "rollout: {multi_turn: {env: no_such_pkg.envs:Env}}\n",
        [],
        "cannot import module 'no_such_pkg.envs'",
    ),
    "unknown_tool": ("rollout: {multi_turn: {env: tools}}\ndata: {tools: [no_such_tool]}\n", [], "data.tools"),
    "env_kwargs": (
        "rollout: {multi_turn: {env: retry, env_kwargs: {colour: red}}}\n",
        [],
        "got an unexpected keyword argument 'colour'",
    ),
    # on-policy distillation: the teacher and the distillation signal go together
    "distill_without_teacher": (
        "algorithm: {distill: {coef: 1.0}}\n",
        [],
        "algorithm.distill.coef: distillation needs a teacher",
    ),
    "teacher_without_distill": ("model: {teacher_path: t}\n", [], "model.teacher_path: a teacher is used by"),
    "distill_with_a_critic": (
        "model: {teacher_path: t}\nalgorithm: {estimator: gae, distill: {coef: 1.0}}\n",
        [],
        "distillation pairs with critic-free estimators",
    ),
    "int8_teacher_zero3": (
        "model: {teacher_path: t}\nalgorithm: {distill: {coef: 1.0}}\nprecision: {teacher_dtype: int8}\n"
        "roles:\n  teacher: {ds_config: teacher_zero3.json}\n",
        [],
        "roles.teacher.ds_config: an int8 teacher needs a ZeRO stage-0 config",
    ),
    "distill_mode": ("algorithm: {distill: {mode: forward}}\n", [], "algorithm.distill.mode: 'forward' is not one"),
    # files
    "yaml_not_utf8": (b"trainer: {run_dir: caf\xe9}\n", [], "not UTF-8 text"),
    "json_not_utf8": ("roles:\n  actor: {ds_config: LATIN1}\n", [], "not UTF-8 text"),
    "run_dir_is_a_file": ("trainer: {run_dir: AFILE}\n", [], "trainer.run_dir: "),
    "resume_is_a_file": ("trainer: {resume: AFILE}\n", [], "trainer.resume: "),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(tmp_path, case, capsys, monkeypatch):
    text, overrides, expected = BAD_INPUTS[case]
    bad = _write(tmp_path, "bad.json", '{"zero_optimization": {"stage": 2,}')
    both = _write(tmp_path, "both.json", json.dumps({"fp16": {"enabled": True}, "bf16": {"enabled": True}}))
    stage0 = _write(tmp_path, "s0.json", json.dumps({"zero_optimization": {"stage": 0}}))
    stage2 = _write(tmp_path, "s2.json", json.dumps({"zero_optimization": {"stage": 2}}))
    tbs = _write(tmp_path, "tbs.json", json.dumps({"train_batch_size": 7}))
    stage5 = _write(tmp_path, "s5.json", json.dumps({"zero_optimization": {"stage": 5}}))
    micro0 = _write(tmp_path, "m0.json", json.dumps({"train_micro_batch_size_per_gpu": 0}))
    twice = _write(tmp_path, "twice.json", '{"zero_optimization": {"stage": 3},\n "zero_optimization": {"stage": 0}}')
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(b'{"wall_clock_breakdown": false, "caf\xe9": 1}')
    afile = _write(tmp_path, "a_file", "not a directory")
    damaged = {"BADCFGDIR": ("{", None), "CUTDIR": ("{}", "cut"), "NOTSTDIR": ("{}", "text")}
    for name, (config, weights) in damaged.items():
        d = tmp_path / name.lower()
        d.mkdir()
        (d / "config.json").write_text(config)
        (d / "tokenizer.json").write_text("{}")
        if weights == "cut":  # a real safetensors file, its last bytes lost (a copy cut short)
            save_file({"w": torch.ones(64, 64)}, str(d / "model.safetensors"))
            data = (d / "model.safetensors").read_bytes()
            (d / "model.safetensors").write_bytes(data[:-100])
        elif weights == "text":
            (d / "model.safetensors").write_bytes((8).to_bytes(8, "little") + b"not json")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notok").mkdir()
    (tmp_path / "notok" / "config.json").write_text("{}")
    places = {
        "BADJSON": bad,
        "BOTHJSON": both,
        "STAGE0": stage0,
        "STAGE2": stage2,
        "TBS": tbs,
        "STAGE5": stage5,
        "MICRO0": micro0,
        "TWICEJSON": twice,
        "LATIN1": str(latin1),
        "AFILE": afile,
        "EMPTYDIR": str(tmp_path / "empty"),
        "NOTOKDIR": str(tmp_path / "notok"),
        **{name: str(tmp_path / name.lower()) for name in damaged},
    }
    if not isinstance(text, bytes):  # bytes: a file that is not UTF-8, written as it is
        for name, value in places.items():
            text = text.replace(name, value)
        text = text.encode()
    cfg = tmp_path / "run.yaml"
    cfg.write_bytes(text)
    # the command in this process (a traceback would raise here): its exit code and what it printed, from
    # the repo root as a user's shell holds it (an in-process run earlier set WORLD_SIZE)
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    capsys.readouterr()
    rc = main(["config", "render", "--config", str(cfg), *overrides])
    out = capsys.readouterr()
    assert rc == 2, out.out[-2000:] + out.err
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.err
    assert expected in lines[0]


def test_every_mistake_of_a_config_is_reported_at_once(tmp_path):
    """Three independent mistakes: three lines, exit 2, nothing else."""
    cfg = _write(tmp_path, "run.yaml", "trainer: {stepz: 3, steps: -1}\nrollout: {engine: hff}\n")
    out = cli("config", "render", "--config", cfg)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: trainer.stepz: unknown key (did you mean 'trainer.steps'?)",
        "error: rollout.engine: 'hff' is not one of vllm, hf, auto",
        "error: trainer.steps: must be > 0, got -1",
    ], out.stderr


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--gpu-memory-gb", "-1"], "argument --gpu-memory-gb: must be > 0, got -1"),
        (["--world-size", "0"], "argument --world-size: must be > 0, got 0"),
    ],
)
def test_cli_numbers_out_of_range_are_one_line(args, expected):
    cfg = ROOT / "examples" / "grpo_cpu_tiny.yaml"
    out = cli("debug", "memory", "--config", str(cfg), "--model-config", str(ROOT / "tests" / "data" / "x"), *args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and expected in lines[0], out.stderr


def test_render_without_the_model_or_data_lists_what_it_could_not_resolve():
    """The GPU example's DeepSpeed JSONs, on a machine without its model and data: refused as `train` would
    refuse them, or with --allow-absent listed (a config for another machine)."""
    gpu = ["config", "render", "--config", str(ROOT / "examples" / "grpo_gpu_qwen05b.yaml")]
    out = cli(*gpu)
    assert out.returncode == 2 and "error: model.path: directory not found" in out.stderr, out.stderr
    out = cli(*gpu, "--allow-absent", "roles.actor.zero_stage=auto")
    assert out.returncode == 0, out.stderr
    assert "#   model.path: directory not found: /models/Qwen2.5-0.5B-Instruct (a run stops here)" in out.stdout
    assert "#   data.train_files[0]: file not found: data/gsm8k_train.jsonl" in out.stdout
    assert "#   roles.actor.zero_stage: auto is chosen at start" in out.stdout
    assert "# actor: DeepSpeed config" in out.stdout and "# reference: DeepSpeed config" in out.stdout


def test_train_with_a_data_file_that_is_not_utf8_is_one_line(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "4"}\n')
    out = cli(
        "train",
        "--config",
        str(CPU_GRPO),
        "data.task=files",
        f"data.train_files=[{bad}]",
        f"trainer.run_dir={tmp_path / 'run'}",
        "logging.wandb.mode=disabled",
        "rollout.engine=hf",
    )
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {bad}:2: not UTF-8 text"), out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # found after the setup: nothing left behind


def test_version_flag():
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("verl-ds ")


def test_prompts_must_split_evenly_over_ranks():
    out = cli("config", "render", "--config", str(CPU_GRPO), "--world-size", "3", "trainer.prompts_per_step=4")
    assert out.returncode == 2 and "trainer.prompts_per_step" in out.stderr


def test_train_with_missing_model_dir_is_one_line(tmp_path):
    out = cli(
        "train",
        "--config",
        str(CPU_GRPO),
        "model.reward_path=/no/such/rm",
        f"trainer.run_dir={tmp_path}",
        "logging.wandb.mode=disabled",
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == ["error: model.reward_path: directory not found: /no/such/rm"]
    assert "Traceback" not in out.stderr


def test_train_with_malformed_jsonl_line_is_one_line(tmp_path):
    bad = _write(tmp_path, "bad.jsonl", '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": 4\n')
    out = cli(
        "train",
        "--config",
        str(CPU_GRPO),
        "data.task=files",
        f"data.train_files=[{bad}]",
        f"trainer.run_dir={tmp_path / 'run'}",
        "logging.wandb.mode=disabled",
        "rollout.engine=hf",
    )
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {bad}:2: malformed JSON line"), out.stderr
    assert "Traceback" not in out.stderr


def _train(tmp_path, *overrides):
    return cli(
        "train",
        "--config",
        str(CPU_GRPO),
        f"trainer.run_dir={tmp_path / 'run'}",
        "logging.wandb.mode=disabled",
        "rollout.engine=hf",
        *overrides,
    )


def test_train_with_a_prompt_that_is_not_a_string_is_one_line(tmp_path):
    """A number (or a list of messages) would otherwise train as its repr."""
    bad = _write(tmp_path, "bad.jsonl", '{"prompt": "1+1=", "answer": "2"}\n{"prompt": 17, "answer": 4}\n')
    out = _train(tmp_path, "data.task=files", f"data.train_files=[{bad}]")
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {bad}:2: 'prompt' must be a string, got 17"], out.stderr


def test_a_rollout_batch_that_cannot_fit_is_refused_before_any_engine(tmp_path):
    """`rollout.n: 1000000000`: one line naming the keys and the memory, before DeepSpeed starts
    (not a MemoryError, or the OOM killer, once generation allocates the batch)."""
    out = _train(tmp_path, "rollout.n=1000000000")
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rollout.n: trainer.prompts_per_step x rollout.n = "), (
        errors
    )
    assert "GiB to generate, over this rank's" in errors[0]
    assert "Traceback" not in out.stderr and "DeepSpeed info" not in out.stdout + out.stderr


def test_prompts_over_max_prompt_length_get_one_warning_with_the_count(caplog):
    from verl_ds.data.chat import ChatCodec
    from verl_ds.data.dataset import tokenize_prompts
    from verl_ds.data.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    examples = [{"prompt": p} for p in ("1+1=", "12+34+56=", "12+34+56=", "7*8*9*10=")]
    with caplog.at_level("WARNING", logger="verl_ds"):
        rows = tokenize_prompts(examples, ChatCodec(tok, False), 6)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "data.max_prompt_length: 2 of 3 distinct prompts are longer than 6 tokens and keep only their last 6"
    ]
    assert [len(r["prompt_ids"]) for r in rows] == [len(tok("1+1=")["input_ids"]), 6, 6, 6]
    caplog.clear()
    with caplog.at_level("WARNING", logger="verl_ds"):
        tokenize_prompts(examples, ChatCodec(tok, False), 64)
    assert not caplog.records


def test_debug_memory_plan_given_a_weights_file_as_the_model_config_is_one_line(tmp_path):
    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4, 4)}, str(weights))
    out = cli(
        "debug", "memory", "--plan", "--config", str(CPU_GRPO), "--model-config", str(weights), "--gpu-memory-gb", "80"
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {weights}: not UTF-8 text (byte "), out.stderr
    assert lines[0].endswith("is it an HF config.json?")


def test_train_with_a_validation_file_missing_the_prompt_key_is_one_line(tmp_path):
    good = _write(tmp_path, "train.jsonl", '{"prompt": "1+1=", "answer": "2"}\n')
    val = _write(tmp_path, "val.jsonl", '{"question": "2+2=", "answer": "4"}\n')
    out = cli(
        "train",
        "--config",
        str(CPU_GRPO),
        "data.task=files",
        f"data.train_files=[{good}]",
        f"data.val_files=[{val}]",
        "data.val_fraction=0",
        f"trainer.run_dir={tmp_path / 'run'}",
        "logging.wandb.mode=disabled",
        "rollout.engine=hf",
    )
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: data.prompt_key: 'prompt' missing in {val}:1 (keys: ['answer', 'question'])"], out.stderr


@pytest.mark.parametrize(
    "override,expected",
    [
        (
            "rollout.multi_turn.env=no_such_pkg.envs:Env",
            "error: rollout.multi_turn.env: cannot import module 'no_such_pkg.envs' (No module named 'no_such_pkg'); "
            "is it on PYTHONPATH?",
        ),
        (
            "rollout.multi_turn.env_kwargs={max_tries: 3, colour: red}",
            "error: rollout.multi_turn.env_kwargs: RetryEnv(max_tries, colour): "
            "got an unexpected keyword argument 'colour'",
        ),
        (
            "rollout.multi_turn.env_kwargs={max_tries: '3'}",
            "error: rollout.multi_turn.env_kwargs.max_tries: RetryEnv takes max_tries: int, got '3' (str)",
        ),
    ],
)
def test_train_with_a_bad_environment_is_one_line_at_start(tmp_path, override, expected):
    out = cli(
        "train",
        "--config",
        str(ROOT / "examples" / "grpo_cpu_tiny_retry.yaml"),
        override,
        f"trainer.run_dir={tmp_path}",
        "logging.wandb.mode=disabled",
        "rollout.engine=hf",
    )
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.strip().splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(expected), out.stderr
    assert "Traceback" not in out.stderr


def test_an_environment_file_that_does_not_import_is_one_line_with_its_file_and_line(tmp_path):
    """A syntax error (or any exception while the module runs) in the user's environment file: one
    line at start naming the file and the line, even for `config render`."""
    (tmp_path / "my_env.py").write_text("class Env:\n    def reset(self, example)\n        return None\n")
    (tmp_path / "raising_env.py").write_text("import os\n\nBOARD = os.environ['NO_SUCH_VARIABLE']\n")
    for module, expected in (
        ("my_env", f"importing 'my_env' failed at {tmp_path / 'my_env.py'}:2: SyntaxError:"),
        ("raising_env", "importing 'raising_env' failed at "),
    ):
        cfg = ["--config", str(ROOT / "examples" / "grpo_cpu_tiny_retry.yaml"), f"rollout.multi_turn.env={module}:Env"]
        out = cli("config", "render", *cfg, cwd=tmp_path)
        assert out.returncode == 2, out.stderr[-2000:]
        errors = out.stderr.strip().splitlines()
        assert len(errors) == 1 and errors[0].startswith(f"error: rollout.multi_turn.env: {expected}"), out.stderr
    assert "KeyError: 'NO_SUCH_VARIABLE'" in errors[0]


def test_config_reference_is_generated_and_current():
    """docs/CONFIG.md is what `verl-ds config docs` prints now: regenerate it when a field changes."""
    from verl_ds.config import config_reference

    assert (ROOT / "docs" / "CONFIG.md").read_text() == config_reference(), (
        "docs/CONFIG.md is stale: run `verl-ds config docs > docs/CONFIG.md`"
    )


def test_every_config_key_has_help():
    import dataclasses

    from verl_ds.config import RunConfig

    def undocumented(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if not f.metadata.get("help"):
                yield prefix + f.name
            if dataclasses.is_dataclass(value):
                yield from undocumented(value, f"{prefix}{f.name}.")

    assert list(undocumented(RunConfig())) == []


@pytest.mark.parametrize(
    "actor,rollout,warns",
    [
        ("fp32", "auto", False),
        ("bf16", "bf16", False),
        ("fp16", "auto", False),
        ("fp32", "bf16", True),
        ("bf16", "fp16", True),
    ],
)
def test_actor_rollout_dtype_mismatch_warns_once_in_one_line(caplog, actor, rollout, warns):
    import logging

    from verl_ds.precision import PrecisionConfig, resolve_precision

    with caplog.at_level(logging.WARNING, logger="verl_ds.precision"):
        r = resolve_precision(PrecisionConfig(actor_dtype=actor, rollout_dtype=rollout), AVX512_BF16)
    lines = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(lines) == int(warns), lines
    if warns:
        assert "\n" not in lines[0] and f"actor computes in {actor} and the rollout in {r.rollout}" in lines[0]


@pytest.mark.parametrize("hostfile", ["missing", "empty"])
def test_launch_with_a_missing_or_empty_hostfile_is_one_line_before_launch(tmp_path, hostfile):
    """DeepSpeed's runner would say "will proceed with training with local resources only" and train
    on one machine: train.sh refuses first."""
    path = tmp_path / "hostfile"
    if hostfile == "empty":
        path.write_text("# no hosts yet\n\n")
    out = subprocess.run(
        ["bash", str(ROOT / "launch" / "train.sh"), str(CPU_GRPO), f"trainer.run_dir={tmp_path / 'run'}"],
        env=child_env(HOSTFILE=str(path)),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"error: HOSTFILE: {path} is missing or lists no hosts (one 'host slots=N' line per node)"
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "var, value, line",
    [
        ("NUM_RANKS", "two", "error: NUM_RANKS: 'two' is not a number of ranks (a whole number, e.g. NUM_RANKS=2)"),
        ("NUM_RANKS", "0", "error: NUM_RANKS: 0 ranks; on CPU give 1 or more (0 means one per GPU on a GPU node)"),
        ("MASTER_PORT", "http", "error: MASTER_PORT: 'http' is not a TCP port (1-65535)"),
        ("MASTER_PORT", "70000", "error: MASTER_PORT: '70000' is not a TCP port (1-65535)"),
    ],
)
def test_launch_variables_are_checked_by_train_sh_in_one_line(tmp_path, var, value, line):
    """The launcher would name its own flags (`--num_ranks must be 1..0 ([])`): train.sh names the variable."""
    out = subprocess.run(
        ["bash", str(ROOT / "launch" / "train.sh"), str(CPU_GRPO), f"trainer.run_dir={tmp_path / 'run'}"],
        env=child_env(**{var: value}),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [line]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "example, override, line",
    [
        (
            "grpo_cpu_tiny_agent.yaml",
            "rollout.multi_turn.agent=examples.agents.arithmetic.retry_agent",
            "rollout.multi_turn.agent: 'examples.agents.arithmetic.retry_agent': name the agent as module:function "
            "(e.g. examples.agents.arithmetic:retry_agent)",
        ),
        (
            "grpo_cpu_tiny_retry.yaml",
            "rollout.multi_turn.env_kwargs=3",
            "rollout.multi_turn.env_kwargs: expected dict, got 3",
        ),  # noqa: E501
        (
            "grpo_cpu_smollm2_textarena.yaml",
            "rollout.multi_turn.env=textarena:GuessTheNumber-v0",
            "rollout.multi_turn.env: 'textarena:GuessTheNumber-v0': the built-in environment is `env: textarena`, "
            "its game in env_kwargs: {env_id: GuessTheNumber-v0}",
        ),
        (
            "grpo_cpu_smollm2_textarena.yaml",
            "rollout.multi_turn.env_kwargs.game_kwargs.colour=red",
            "rollout.multi_turn.env_kwargs.game_kwargs: GuessTheNumber-v0: got an unexpected keyword argument 'colour'",
        ),
    ],
)
def test_multi_turn_names_that_cannot_run_are_one_line_at_start(example, override, line):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "examples" / example, [override])
    assert line in [str(x) for x in e.value.errors]


def test_the_readmes_config_render_works_for_every_example_from_the_repo_root():
    """The README's path, `verl-ds config render --config <example>` from the repo root, with the
    `verl-ds` console script (which puts no directory on sys.path by itself): the examples render, the
    agent example's `examples.agents...` module included. A model or data file not made yet is
    listed as unresolved with --allow-absent (without it, refused as `train` refuses it)."""
    exe = Path(sys.executable).parent / "verl-ds"
    # the README's example, and the one whose agent module imports from the directory the command runs in
    # (every example renders in-process: tests/config/test_dry_run.py)
    for example in (ROOT / "examples" / "grpo_cpu_tiny.yaml", ROOT / "examples" / "grpo_cpu_tiny_agent.yaml"):
        out = subprocess.run(
            [str(exe), "config", "render", "--config", f"examples/{example.name}", "--allow-absent"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=child_env(PYTHONPATH=""),
            timeout=300,
        )
        assert out.returncode == 0, (example.name, out.stderr[-2000:])


PROMPT_ROW, QUESTION_ROW = '{"prompt": "1+1=", "answer": "2"}\n', '{"question": "2+2=", "answer": "4"}\n'


@pytest.mark.parametrize(
    "files, line",
    [
        ({"train.jsonl": ""}, "data.train_files[0]: {d}/train.jsonl holds no rows"),
        (
            {"train.parquet": "not parquet"},
            "data.train_files[0]: {d}/train.parquet is not a parquet file (no PAR1 header)",
        ),  # noqa: E501
        (
            {"train.jsonl": PROMPT_ROW, "val.jsonl": QUESTION_ROW},
            "data.prompt_key: 'prompt' missing in {d}/val.jsonl:1 (keys: ['answer', 'question'])",
        ),
    ],
)
def test_config_render_refuses_the_data_files_train_would_refuse(tmp_path, files, line):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    train = [str(tmp_path / n) for n in files if n.startswith("train")]
    val = [str(tmp_path / n) for n in files if n.startswith("val")]
    args = ["config", "render", "--config", str(CPU_GRPO), "data.task=files", f"data.train_files={train}"]
    out = run_cli(*args, *([f"data.val_files={val}"] if val else []), cwd=ROOT)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == ["error: " + line.format(d=tmp_path)]


SP = ["trainer.sequence_parallel_size=2"]  # one-row micro-batches follow (`config.micro_rows`)


def test_sequence_parallel_batches_count_data_parallel_ranks_and_one_row_a_micro_batch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = load_config(CPU_PPO, [*SP, "roles.actor.max_tokens_per_micro_batch=auto"])
    actor = render_ds_configs(cfg, world_size=4)["actor"]  # 4 ranks at SP 2: 2 data-parallel ranks
    rows = cfg.trainer.prompts_per_step * cfg.rollout.n
    assert (actor["train_batch_size"], actor["train_micro_batch_size_per_gpu"]) == (rows, 1)
    assert actor["gradient_accumulation_steps"] == rows // 2
    from verl_ds.config import token_budget

    assert token_budget(cfg, "actor") == 0  # no packing: each micro-batch one row, split


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.engine=hf", "rollout.engine"),
        ("model.packing=true", "model.packing"),
        ("trainer.sequence_parallel_size=3", "trainer.sequence_parallel_size"),  # does not divide 2 ranks
    ],
)
def test_sequence_parallel_refuses_what_it_cannot_split_in_one_line(override, key):
    out = cli("config", "render", "--config", str(CPU_PPO), "--world-size", "2", *SP, override)
    assert out.returncode == 2 and key in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "overrides",
    [
        ["roles.actor.offload_activations=true"],  # nothing checkpointed to offload
        ["roles.reference.offload_activations=true", "precision.enable_grad_checkpointing=true"],  # frozen
    ],
)
def test_offloading_activations_needs_a_trained_role_that_checkpoints(overrides):
    out = cli("config", "render", "--config", str(CPU_PPO), *overrides)
    key = overrides[0].split("=")[0]
    assert out.returncode == 2 and key in out.stderr and "Traceback" not in out.stderr, out.stderr
