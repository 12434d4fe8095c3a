"""A LoRA actor in one process (HF rollout, real DeepSpeed engines): only adapters train, the
reference is exactly the base, the export writes adapters or the merged model, and `debug memory`'s
estimate accounts adapters vs the frozen base with no reference copy."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.diagnostics.helpers import tiny_overrides
from verl_ds.config import load_config
from verl_ds.diagnostics import memory as M
from verl_ds.ds_config import render_ds_configs, run_precision
from verl_ds.roles.batch import TrainBatch
from verl_ds.roles.ds_internals import full_numel
from verl_ds.trainer.rl_trainer import RLTrainer

LORA = [
    "model.lora.rank=4",
    "roles.actor.lr=0.01",
    "data.reward_fn=tests.e2e.helpers:length_reward",
    "trainer.prompts_per_step=4",
    "rollout.n=4",
    "roles.actor.micro_batch_size=8",
    "rollout.temperature=1.0",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("lora")
    cfg = load_config(None, tiny_overrides(run) + LORA)
    with RLTrainer(cfg) as t:
        t.track_activations = True
        batch = TrainBatch(torch.randint(3, 15, (4, 9)), torch.ones(4, 9, dtype=torch.long), torch.ones(4, 3))
        ref0 = t.reference.logprobs(batch)
        metrics = [t.step() for _ in range(3)]
        out = dict(
            cfg=cfg,
            trainer=t,
            metrics=metrics,
            ref0=ref0,
            ref3=t.reference.logprobs(batch),
            actor3=t.actor.logprobs(batch),
        )
        t.export(run / "merged", "fp32")
        cfg.checkpoint.export = "adapter"
        t.export(run / "adapter", "fp32")
        yield out, run


def test_only_adapters_train_and_no_reference_engine(trained):
    out, _ = trained
    t = out["trainer"]
    names = [n for n, p in t.actor.module.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert "reference" not in render_ds_configs(out["cfg"], 1)  # no second DeepSpeed engine
    assert not hasattr(t.reference, "engine")  # the actor, adapters disabled


@pytest.mark.numerics
def test_reference_is_exactly_the_base_while_the_policy_moves(trained):
    out, _ = trained
    assert torch.equal(out["ref0"], out["ref3"])  # adapters off: base weights, bitwise
    assert (out["actor3"] - out["ref3"]).abs().max() > 1e-4  # the adapters did change the policy
    assert out["metrics"][-1]["actor/kl_ref"] > 0


def test_exports_merged_and_adapter(trained):
    out, run = trained
    base = load_file(str(run / "init_model" / "model.safetensors"))
    merged = load_file(str(run / "merged" / "model.safetensors"))
    assert set(merged) == set(base) and any(not torch.equal(base[k], merged[k]) for k in base)
    adapter = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["r"] == 4


def test_memory_estimate_accounts_lora(trained):
    out, _ = trained
    cfg, t = out["cfg"], out["trainer"]
    shape = M.ModelShape.from_hf_config(json.loads(Path(t.model_path, "config.json").read_text()))
    est = M.estimate_memory(cfg, shape, render_ds_configs(cfg, 1), 1, run_precision(cfg).rollout)["update"]
    measured = M.stages_from_metrics(out["metrics"][-1])["update"]
    adapters = shape.lora_params(4, cfg.model.lora.target_modules)
    assert adapters == sum(full_numel(p) for n, p in t.actor.module.named_parameters() if "lora_" in n)
    for c in ("weights_fp32", "master", "grads", "optimizer"):
        e, m = est["actor"][c], measured["actor"][c]
        assert abs(e - m) <= 0.05 * m, f"actor/{c}: estimate {e} vs measured {m}"
    assert est["actor"]["optimizer"] == 8 * adapters  # Adam states for the adapters only
    assert "reference" not in est and not measured.get("reference")  # no reference copy


def test_peft_names_map_to_the_base_checkpoint():
    from verl_ds.roles.lora import hf_name

    assert (
        hf_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
        == "model.layers.0.self_attn.q_proj.weight"
    )
    assert hf_name("base_model.model.model.norm.modules_to_save.default.weight") == "model.norm.weight"
    assert hf_name("base_model.model.lm_head.weight") == "lm_head.weight"


@pytest.mark.numerics
def test_modules_to_save_sync_into_a_plain_model(tiny_model_dir):
    """A LoRA model with a fully trained norm and (tied) embedding streams merged weights a plain HF
    model accepts whole: the trained embedding copy stays tied to the head, as in the engine."""
    from verl_ds.roles.lora import apply_lora, iter_merged_params
    from verl_ds.roles.policy import load_causal_lm

    model = apply_lora(load_causal_lm(tiny_model_dir), 4, 8.0, 0.0, ["q_proj", "v_proj"], ["norm", "embed_tokens"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "modules_to_save" in n:
                p.add_(0.5)
    plain = load_causal_lm(tiny_model_dir)
    sd = dict(iter_merged_params(model))
    assert set(sd) == set(plain.state_dict()) - ({"lm_head.weight"} if plain.config.tie_word_embeddings else set())
    plain.load_state_dict(sd, strict=False)
    ids = torch.tensor([[1, 5, 6, 13]])
    assert torch.allclose(plain(ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_lora_adapters_on_a_tied_embedding_are_refused(tiny_model_dir, tmp_path):
    """The tiny model ties its embeddings: an adapter on either side cannot be merged into the
    engine's one matrix, so the run stops with one line (modules_to_save keeps them tied)."""
    import subprocess
    import sys

    from tests.subprocess_env import child_env
    from verl_ds.roles.lora import tied_embedding_targets
    from verl_ds.roles.policy import load_causal_lm

    model = load_causal_lm(tiny_model_dir)
    assert tied_embedding_targets(model, ["q_proj", "embed_tokens", "lm_head", "norm"]) == ["embed_tokens", "lm_head"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_ds.cli",
            "train",
            "--config",
            "examples/grpo_cpu_tiny.yaml",
            f"trainer.run_dir={tmp_path}",
            "model.lora.rank=4",
            "model.lora.target_modules=[q_proj,lm_head]",
            "rollout.engine=hf",
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "model.lora.target_modules" in out.stderr and "Traceback" not in out.stderr, (
        out.stderr[-2000:]
    )
