"""The run's setup: every fact derived once, before any engine (a one-rank process group)."""

import dataclasses

import pytest

from verl_ds import config
from verl_ds.config import load_config
from verl_ds.ds_config import render_ds_configs, run_precision
from verl_ds.errors import ConfigError
from verl_ds.roles import attention
from verl_ds.rollout import resolve_eager
from verl_ds.trainer.setup import resolve_setup


def _cfg(tmp_path, *extra):
    return load_config(
        None,
        [
            "rollout.engine=auto",
            "trainer.prompts_per_step=4",
            "rollout.n=4",
            "trainer.mini_batch_size=8",
            "algorithm.estimator=gae",  # a critic: three roles, two trained
            "roles.actor.zero_stage=auto",
            f"trainer.run_dir={tmp_path}",
            "model.tiny.hidden=32",
            "model.tiny.ffn=64",
            *extra,
        ],
        world_size=1,
    )


def test_the_setup_reads_each_roles_json_once_and_holds_what_the_run_derives(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    reads = []
    read = config.read_ds_json
    monkeypatch.setattr("verl_ds.config.read_ds_json", lambda name, key: reads.append(key) or read(name, key))
    s = resolve_setup(cfg)
    assert sorted(reads) == ["roles.actor.ds_config", "roles.critic.ds_config", "roles.reference.ds_config"]
    assert s.roles == ("actor", "critic", "reference") and s.trained == ("actor", "critic")
    assert s.cfg.rollout.engine == "hf"
    assert (s.rank, s.world, s.gpu) == (0, 1, False)
    assert s.mini_rows == 8 and s.tools == () and s.env_factory is None and s.agent is None
    assert s.resume_from is None  # trainer.resume: none
    assert s.reward_fn("1", "1") == 1.0  # data.reward_fn: arithmetic
    # the rendered configs are what the renderer gives for the ZeRO stage auto chose
    stage = s.ds["actor"]["zero_optimization"]["stage"]
    assert dict(s.ds) == render_ds_configs(s.cfg, 1, run_precision(s.cfg), {"actor": stage})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.world = 2
    with pytest.raises(TypeError):
        s.ds["actor"] = {}


def test_the_callers_reward_function_wins_and_mini_batch_size_0_is_every_row(tmp_path):
    def fn(response, answer):
        return 0.5

    s = resolve_setup(_cfg(tmp_path, "trainer.mini_batch_size=0"), reward_fn=fn)
    assert s.reward_fn is fn and s.mini_rows == 0


def test_attention_and_packing_are_resolved_in_the_setup(tmp_path, monkeypatch):
    """`model.attn_implementation` / `model.packing` auto: flash-attention and packed rows where
    flash-attn runs (a GPU with the package), SDPA and padded rows elsewhere (on CPU the masked pack
    measured slower; SDPA with the math for 16-bit backward passes there); an explicit choice stands;
    flash_attention_2 without it is one error, before any engine."""
    s = resolve_setup(_cfg(tmp_path))
    assert (s.attention, s.packing) == ("sdpa_cpu16", False)
    s = resolve_setup(_cfg(tmp_path, "model.attn_implementation=eager", "model.packing=true"))
    assert (s.attention, s.packing) == ("eager", True)
    with pytest.raises(ConfigError, match="model.attn_implementation: flash_attention_2 needs a CUDA GPU"):
        resolve_setup(_cfg(tmp_path, "model.attn_implementation=flash_attention_2"))
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: None)  # a GPU without flash-attn
    assert attention.resolve("auto", "auto", gpu=True) == ("sdpa", False)
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else None)
    assert attention.resolve("auto", "auto", gpu=True) == ("flash_attention_2", True)
    assert attention.resolve("auto", False, gpu=True) == ("flash_attention_2", False)
    assert attention.resolve("auto", "auto", gpu=False) == ("sdpa_cpu16", False)
    assert attention.resolve("sdpa", "auto", gpu=False) == ("sdpa", False)


def test_vllm_compilation_is_resolved_in_the_setup(tmp_path):
    """`rollout.enforce_eager` auto: compiled with CUDA graphs on a GPU, eager on CPU (compiling costs
    more at start than a short CPU run's generation saves); an explicit choice stands."""
    assert resolve_setup(_cfg(tmp_path)).cfg.rollout.enforce_eager is True
    assert resolve_setup(_cfg(tmp_path, "rollout.enforce_eager=false")).cfg.rollout.enforce_eager is False
    assert (resolve_eager("auto", gpu=True), resolve_eager("auto", gpu=False)) == (False, True)
    assert (resolve_eager(True, gpu=True), resolve_eager(False, gpu=False)) == (True, False)


LONG = (
    "data.max_prompt_length=60000",
    "rollout.max_model_len=60016",
    "rollout.max_new_tokens=16",
    "model.tiny.max_positions=60016",
)


def test_auto_token_budgets_come_from_memory_and_a_stated_budget_is_kept(tmp_path, caplog):
    """`max_tokens_per_micro_batch: auto` is micro_batch_size rows where memory allows, fewer full-length
    rows where the memory model says they do not fit this rank (`trainer.rank_memory_gb`)."""
    from verl_ds.config import longest_row

    roomy = resolve_setup(_cfg(tmp_path, *LONG, "trainer.rank_memory_gb=64", "roles.actor.micro_batch_size=2"))
    t = longest_row(roomy.cfg)
    assert roomy.token_budgets["actor"] == 2 * t  # micro_batch_size x the longest row: memory allows it
    caplog.set_level("INFO", logger="verl_ds")
    tight = resolve_setup(_cfg(tmp_path, *LONG, "trainer.rank_memory_gb=2", "roles.actor.micro_batch_size=8"))
    assert t <= tight.token_budgets["actor"] < 8 * t  # whole rows, fewer of them
    assert tight.token_budgets["actor"] % t == 0
    assert "token budget per micro-batch: actor" in caplog.text and "memory" in caplog.text
    stated = resolve_setup(
        _cfg(tmp_path, *LONG, "trainer.rank_memory_gb=2", "roles.actor.max_tokens_per_micro_batch=480000")
    )
    assert stated.token_budgets["actor"] == 480000  # the user's number stands, with a warning
    assert "roles.actor: micro-batches of 480000 tokens may not fit" in caplog.text


def test_a_row_that_cannot_fit_one_rank_is_refused_before_any_engine_naming_what_would(tmp_path):
    with pytest.raises(ConfigError) as e:
        resolve_setup(_cfg(tmp_path, *LONG, "trainer.rank_memory_gb=1"))
    msg = str(e.value)
    assert msg.startswith("roles.actor") and "60,016-token row's update pass needs" in msg
    assert "over this rank's 1.0 GiB" in msg and "precision.enable_grad_checkpointing: true" in msg
    assert not (tmp_path / "checkpoints").exists()  # refused before the run's directories


def test_a_token_budget_below_one_row_is_a_warning_naming_the_effective_budget(tmp_path, caplog):
    caplog.set_level("WARNING", logger="verl_ds")
    s = resolve_setup(_cfg(tmp_path, "roles.actor.max_tokens_per_micro_batch=4"))
    from verl_ds.config import longest_row

    t = longest_row(s.cfg)
    assert s.token_budgets["actor"] == 4
    assert f"roles.actor.max_tokens_per_micro_batch 4 is below one row of up to {t} tokens" in caplog.text
    assert f"so up to {t} tokens run in one" in caplog.text


def test_a_vllm_context_past_the_models_positions_is_one_line(tmp_path):
    """The tiny model has 256 positions; vLLM would fail at its engine start with a traceback."""
    with pytest.raises(ConfigError) as e:
        resolve_setup(_cfg(tmp_path, "rollout.engine=vllm", "rollout.max_model_len=512"))
    assert str(e.value).startswith("rollout.max_model_len: 512 is past the model's 256 positions")
    resolve_setup(_cfg(tmp_path, "rollout.engine=hf", "rollout.max_model_len=512"))  # HF: the rows' length counts


def test_rows_past_the_models_positions_are_refused_for_the_hf_engine_too(tmp_path):
    """HF generate would run on past the 256 positions silently: one line naming the keys and the limit."""
    hf = ("rollout.engine=hf", "rollout.max_model_len=512", "rollout.max_new_tokens=8")
    with pytest.raises(ConfigError) as e:
        resolve_setup(_cfg(tmp_path, *hf, "data.max_prompt_length=250"))
    line = str(e.value)
    assert "\n" not in line and line.startswith("data.max_prompt_length: data.max_prompt_length + rollout.max_new")
    assert "up to 258 tokens, past the model's 256 positions" in line and "model.tiny.max_positions" in line
    assert not (tmp_path / "checkpoints").exists()  # refused before the run's directories
    resolve_setup(_cfg(tmp_path, *hf, "data.max_prompt_length=248"))


def test_model_tiny_settings_that_differ_from_the_built_model_rebuild_it_or_are_one_line(tmp_path):
    """An init_model nothing trained yet follows the config; one a checkpoint trained is the run's model:
    other settings are one line (a resume would otherwise load the checkpoint's shape without a word)."""
    import json

    from verl_ds.data.tiny import prepare_model

    def build(*overrides):  # the builder's first part, after the setup (its process group)
        return prepare_model(resolve_setup(_cfg(tmp_path, *overrides)).cfg.model, str(tmp_path))

    first = build()
    assert json.loads((tmp_path / "init_model" / "config.json").read_text())["hidden_size"] == 32
    build("model.tiny.hidden=48")  # nothing trained: built again
    assert json.loads((tmp_path / "init_model" / "config.json").read_text())["hidden_size"] == 48
    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        build("model.tiny.hidden=64")
    assert str(e.value).startswith("model.tiny: ") and "hidden 48 -> 64" in str(e.value)
    assert first == str(tmp_path / "init_model")


def test_the_config_is_refused_before_the_process_group_and_the_gpu_is_bound_before_any_cuda_call(
    tmp_path, monkeypatch
):
    """The setup in dependency order: this rank's GPU bound before the precision reads the hardware (a CUDA
    call before it opens a context on cuda:0 in every rank); a config its models refuse ends before the
    process group forms (nothing to wait for, nothing to tear down)."""
    import verl_ds.trainer.setup as setup

    calls = []
    monkeypatch.setattr(setup, "bind_device", lambda: calls.append("bind_device"))
    hardware = setup.resolve_for_files
    monkeypatch.setattr(setup, "resolve_for_files", lambda *a: calls.append("precision") or hardware(*a))
    group = setup.init_distributed
    monkeypatch.setattr(setup, "init_distributed", lambda *a: calls.append("process group") or group(*a))
    s = resolve_setup(_cfg(tmp_path))
    assert calls == ["bind_device", "precision", "process group"] and s.world == 1
    calls.clear()
    with pytest.raises(ConfigError, match="rollout.max_new_tokens"):  # past the tiny model's positions
        resolve_setup(_cfg(tmp_path, "model.tiny.max_positions=64", "rollout.max_new_tokens=128"))
    assert "process group" not in calls
