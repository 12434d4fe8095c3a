"""`verl-ds debug memory --plan`: placements that fit, cheapest first, and a block that renders."""

import dataclasses
import re

import pytest
import yaml

from tests.diagnostics.helpers import DATA, LLAMA_8B, parse_md_tables
from verl_ds import cli
from verl_ds.config import load_config
from verl_ds.diagnostics.memory import plan as P

QWEN_7B = DATA / "qwen2_7b_config.json"
PPO_8B = [
    "data.max_prompt_length=512",
    "rollout.max_new_tokens=512",
    "rollout.max_model_len=1024",
    *[f"roles.{r}.micro_batch_size=4" for r in ("actor", "critic", "reference", "reward")],
]


def _plan(capsys, config, model, world, *extra):
    args = ["debug", "memory", "--plan", "--config", config, "--model-config", str(model)]
    assert cli.main(args + ["--world-size", str(world), "--gpu-memory-gb", "80", *extra]) == 0
    out = capsys.readouterr().out
    block = re.search(r"```yaml\n(.*?)```", out, re.S)
    assert block, out
    return out, yaml.safe_load(block.group(1))


def _renders(tmp_path, config, overrides, block, world):
    """The printed block, pasted into the run config, loads and renders (`config render`)."""
    path = tmp_path / "planned.yaml"
    base = yaml.safe_load(open(config))
    for section, keys in block.items():
        for k, v in keys.items():
            if isinstance(v, dict):
                base.setdefault(section, {}).setdefault(k, {}).update(v)
            else:
                base.setdefault(section, {})[k] = v
    path.write_text(yaml.safe_dump(base))
    args = ["config", "render", "--config", str(path), *overrides, "--world-size", str(world), "--allow-absent"]
    out = cli.main(args)
    assert out == 0
    return load_config(path, overrides, world_size=world)


@pytest.mark.parametrize("world,prompts", [(1, 8), (8, 64)])
def test_an_8b_ppo_flow_with_a_reward_model_gets_a_plan_that_renders(tmp_path, capsys, world, prompts):
    """The founding question: 8B actor + 8B critic + 8B reference + an 8B reward model on 1 x 80 GB
    (and on 8 x 80 GB): a plan fits, and its block renders."""
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text(LLAMA_8B.read_text())
    overrides = PPO_8B + [f"trainer.prompts_per_step={prompts}", f"model.reward_path={rm}"]
    out, block = _plan(
        capsys,
        "examples/ppo_cpu_tiny.yaml",
        LLAMA_8B,
        world,
        "--reward-config",
        str(LLAMA_8B),
        "--host-memory-gb",
        "1024",
        *PPO_8B,
        f"trainer.prompts_per_step={prompts}",
    )
    with capsys.disabled():
        print(f"\n{out}")
    assert set(block["roles"]) == {"actor", "critic", "reference", "reward"}
    assert "plans fit" in out
    # 1k-token rows: a whole row a micro-batch (no all-to-all) is weighed against a split one, and wins
    assert "trainer" not in block, block
    # the plan is for the 8B model: the tiny stand-in the example names is given its 1k positions
    cfg = _renders(tmp_path, "examples/ppo_cpu_tiny.yaml", [*overrides, "model.tiny.max_positions=1024"], block, world)
    assert cfg.rollout.sleep and cfg.roles.actor.offload == block["roles"]["actor"].get("offload", "none")


def test_a_7b_grpo_on_8_gpus_fits_without_offload(tmp_path, capsys):
    """Qwen2-7B GRPO on 8 x 80 GB: ZeRO shards the states enough that no plan needs the host, so the
    cheapest has neither offload nor sleep (they only add PCIe traffic)."""
    overrides = ["data.train_files=[]", "data.task=arithmetic"]
    out, block = _plan(capsys, "examples/grpo_gpu_qwen05b.yaml", QWEN_7B, 8, *overrides)
    assert set(block["roles"]) == {"actor", "reference"}
    assert all("offload" not in r and "sleep" not in r for r in block["roles"].values()), block
    _renders(tmp_path, "examples/grpo_gpu_qwen05b.yaml", overrides, block, 8)


def test_nothing_fits_is_said_in_one_line(capsys):
    args = ["debug", "memory", "--plan", "--config", "examples/ppo_cpu_tiny.yaml", "--model-config", str(LLAMA_8B)]
    assert cli.main(args + ["--world-size", "1", "--gpu-memory-gb", "8", "--host-memory-gb", "16", *PPO_8B]) == 0
    assert "No placement fits" in capsys.readouterr().out


def test_role_options_follow_deepspeeds_rules():
    actor = P.role_options("actor")
    assert all(o.stage == 3 for o in actor if "params" in o.offload)
    assert all(o.stage >= 1 for o in actor if o.offload == "optimizer" or o.sleep)
    assert not any(o.sleep and "params" in o.offload for o in actor)
    ref = P.role_options("reference")
    assert {o.stage for o in ref} == {0, 3} and not any("optimizer" in o.offload or o.sleep for o in ref)
    assert {o.dtype for o in P.role_options("reward")} == {"bf16", "int8"}


def test_a_64k_row_on_8_gpus_gets_a_sequence_parallel_plan_that_renders(tmp_path, capsys):
    """Llama-3-8B GRPO with 64k-token rows on 8 x 80 GB: no placement fits a whole row on one GPU, so the
    plans split it (SP > 1, one row a micro-batch), and the best block renders."""
    overrides = ["data.train_files=[]", "data.task=arithmetic"]
    out, block = _plan(capsys, "examples/grpo_gpu_qwen05b.yaml", LLAMA_8B, 8, "--row-tokens", "65536", *overrides)
    assert block["trainer"]["sequence_parallel_size"] in (2, 4, 8), block
    assert all(r["micro_batch_size"] == 1 for r in block["roles"].values())
    head, *rows = parse_md_tables(out)[0]
    assert rows and all(int(r[head.index("SP")]) > 1 for r in rows), out  # no plan runs a whole row
    cfg = _renders(tmp_path, "examples/grpo_gpu_qwen05b.yaml", [*overrides, "rollout.max_model_len=65536"], block, 8)
    assert cfg.trainer.sequence_parallel_size == block["trainer"]["sequence_parallel_size"]


def test_sequence_parallel_sizes_follow_deepspeeds_head_rule_in_every_model():
    cfg = load_config("examples/grpo_gpu_qwen05b.yaml", ["data.train_files=[]", "data.task=arithmetic"])
    from verl_ds.diagnostics.memory import load_shape

    llama = load_shape(str(LLAMA_8B))  # 32 heads, 8 key/value heads
    assert P.sp_sizes(cfg, {"actor": llama}, world=8, per_node=8) == [1, 2, 4, 8]
    assert P.sp_sizes(cfg, {"actor": llama}, world=4, per_node=8) == [1, 2, 4]
    smol = dataclasses.replace(llama, heads=9, kv_heads=3)  # SmolLM2-135M's heads
    assert P.sp_sizes(cfg, {"actor": smol}, world=8, per_node=8) == [1]
    with_rm = load_config("examples/ppo_cpu_tiny.yaml", [*PPO_8B, "model.reward_path=x"])
    assert P.sp_sizes(with_rm, {"actor": llama}, world=8, per_node=8) == [1, 2, 4, 8]  # a reward model splits too
    assert P.sp_sizes(with_rm, {"actor": llama, "reward": smol}, world=8, per_node=8) == [1]  # its heads count


def test_rollout_ranks_apart_are_weighed_against_colocated_and_the_best_split_renders(tmp_path, capsys, monkeypatch):
    """Qwen2-7B GRPO on 4 x 80 GB, half of a colocated step generating: the plan weighs 1, 2 and 3 rollout
    ranks (the trainer ranks' cheapest placement, their GPUs without an engine; the step from the
    overlap), says why 3 trainer ranks cannot run 8 prompts a step, and the best split (2 + 2: both sides
    busy) prints a block that renders."""
    overrides = ["data.train_files=[]", "data.task=arithmetic", "trainer.prompts_per_step=8"]
    overrides += ["trainer.mini_batch_size=0"]
    out, _ = _plan(capsys, "examples/grpo_gpu_qwen05b.yaml", QWEN_7B, 4, "--generation-share", "0.5", *overrides)
    apart = out[out.index("## Apart") :]
    rows = {int(r[0]): r for r in parse_md_tables(apart)[0][1:]}
    assert set(rows) == {1, 2, 3}
    assert rows[1][5] == "2.00x" and rows[2][5] == "1.00x" and rows[3][5] == "2.00x"
    assert "prompts_per_step" in rows[1][2] and rows[1][3] == "-"  # 3 trainer ranks do not split 8 prompts
    assert rows[3][3] != "-"  # 1 trainer rank: a placement
    block = yaml.safe_load(re.findall(r"```yaml\n(.*?)```", apart, re.S)[-1])
    assert block["trainer"] == {"rollout_ranks": 2} and block["algorithm"] == {"tis_cap": 2.0}
    assert not any(r.get("sleep") for r in block["roles"].values())  # no engine to hand the GPU to
    assert block["rollout"]["sleep"] is False
    monkeypatch.setenv("WORLD_SIZE", "4")  # the launch the split runs on: 2 trainer + 2 rollout ranks
    monkeypatch.delenv("VERL_DS_LAUNCH_WORLD", raising=False)
    cfg = _renders(tmp_path, "examples/grpo_gpu_qwen05b.yaml", overrides, block, 2)
    assert cfg.trainer.rollout_ranks == 2
    args = ["debug", "memory", "--plan", "--config", "examples/grpo_gpu_qwen05b.yaml", "--model-config", str(QWEN_7B)]
    assert cli.main([*args, "--world-size", "4", "--gpu-memory-gb", "80", "--generation-share", "1.5"]) == 2
    assert "error: --generation-share" in capsys.readouterr().err
