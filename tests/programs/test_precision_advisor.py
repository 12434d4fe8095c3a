"""`verl-ds debug precision` on the tiny PPO example with a reward model: real DeepSpeed engines,
real steps. Each test plants one known problem and checks that exactly that role is flagged with
the right recommendation; the YAML block renders; the memory column is `debug memory`'s estimate."""

import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.diagnostics.helpers import parse_md_tables, tiny_overrides, write_yaml
from verl_ds import cli
from verl_ds.config import apply_overrides, read_yaml

EXAMPLE = "examples/ppo_cpu_tiny.yaml"
ROLES = ["actor", "critic", "reference", "reward"]


def _reward_dir(out: Path, planted: bool) -> str:
    """A tiny LlamaForSequenceClassification on the tiny Llama config of `tiny_overrides`.

    planted: embedding dimension 0 is 1000 for every token, so the final normed hidden state has a
    constant component (sqrt(hidden)) that the score head maps to ~100; the other dimensions vary
    ~1e-4 and weights of std 20 turn that into within-group score differences of ~0.01: below bf16's
    resolution at 100 (0.5) and fp16's (0.0625). Unplanted: score head of std 1, scores of O(1)."""
    from transformers import AutoConfig, LlamaForSequenceClassification

    from verl_ds.data.tiny import build_tiny_llama

    cfg = AutoConfig.from_pretrained(build_tiny_llama(out / "base", hidden=32, ffn=64))
    cfg.num_labels = 1
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(cfg)
    with torch.no_grad():
        if planted:
            rm.model.embed_tokens.weight[:, 0] = 1000.0
            rm.score.weight.normal_(std=20.0)
            rm.score.weight[0, 0] = 0.0
            ids = torch.randint(4, cfg.vocab_size, (64, 12), generator=torch.Generator().manual_seed(1))
            h = rm.model(input_ids=ids).last_hidden_state[:, -1]
            rm.score.weight[0, 0] = (100.0 - float(rm.score(h).mean())) / float(h[:, 0].mean())
        else:
            rm.score.weight.normal_(std=1.0)
    rm.save_pretrained(out / "rm")
    return str(out / "rm")


def _overrides(tmp: Path, reward_dir: str) -> list[str]:
    # rollout.n=4: 6 within-group pairs per prompt; every role's dtype pinned to fp32 (any CPU kind)
    return tiny_overrides(tmp / "run") + [
        f"model.reward_path={reward_dir}",
        "rollout.n=4",
        "precision.reward_dtype=fp32",
    ]


def _recommendations(text: str) -> dict[str, str]:
    body = text.split("### Recommendations", 1)[1].split("```", 1)[0]
    return {ln[2:].split(":", 1)[0].replace(" (flagged)", ""): ln for ln in body.splitlines() if ln.startswith("- ")}


def _weights_column(table) -> dict[tuple[str, str], str]:
    header = table[0]
    return {(r[0], r[1]): r[header.index("weights (est.)")] for r in table[1:]}


def _debug_memory_weights(capsys, overrides, model_config, dtype) -> dict[str, str]:
    """`verl-ds debug memory` (estimate only): each role's weights_<dtype> row of the update stage."""
    args = (
        ["debug", "memory", "--config", EXAMPLE, "--model-config", model_config]
        + overrides
        + [f"precision.{r}_dtype={dtype}" for r in ROLES]
    )
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    update = parse_md_tables(text.split("### stage: update", 1)[1])[0]
    return {r[0]: r[2] for r in update[1:] if r[1] == f"weights_{dtype}"}


def test_planted_reward_resolution_flags_reward_fp32_through_cli(tmp_path, capsys):
    rm = _reward_dir(tmp_path, planted=True)
    ov, out = _overrides(tmp_path, rm), tmp_path / "advice"
    t0 = time.perf_counter()
    assert cli.main(["debug", "precision", "--config", EXAMPLE, "--steps", "2", "--out", str(out)] + ov) == 0
    seconds = time.perf_counter() - t0
    text = capsys.readouterr().out
    with capsys.disabled():
        print(text)
        print(f"debug precision on the tiny PPO example (2 steps, 4 roles): {seconds:.1f} s")
    assert seconds < 120
    recs = _recommendations(text)
    assert sorted(recs) == sorted(ROLES + ["rollout"])  # the rollout: matched to the actor
    assert recs["rollout"].startswith("- rollout: auto: the actor's ")
    flagged = {r for r, ln in recs.items() if "(flagged)" in ln}
    assert flagged == {"reward"}, text
    assert "reward (flagged): fp32: " in recs["reward"]
    assert "of within-group score differences vanish in bf16" in recs["reward"]
    ranges = parse_md_tables(text)[1]
    reward = next(r for r in ranges if r[0] == "reward")
    lo, hi = (float(x) for x in reward[4].strip("[]").split(","))
    assert 99 < lo <= hi < 101  # the planted scores sit near 100
    assert float(reward[-1].split("%")[0]) > 50  # most differences vanish in bf16
    assert "timings are not representative" in text  # fp16 is emulated on CPU

    # the block loads unchanged when merged into the run config
    block = yaml.safe_load((out / "precision.yaml").read_text())
    assert block["precision"]["reward_dtype"] == "fp32"
    run = apply_overrides(read_yaml(EXAMPLE), ov)
    run["precision"].update(block["precision"])
    assert cli.main(["config", "render", "--config", write_yaml(tmp_path / "merged.yaml", run)]) == 0
    capsys.readouterr()

    # the memory column is what `debug memory` estimates for the same config, dtype by dtype
    table = _weights_column(parse_md_tables(text)[0])
    model_config = str(out / "init_model" / "config.json")  # model.path: tiny, built in the run dir
    for dtype in ("fp32", "bf16", "fp16"):
        mem = _debug_memory_weights(capsys, ov, model_config, dtype)
        assert {r: table[(r, dtype)] for r in ROLES} == {r: mem[r] for r in ROLES}, dtype


def test_planted_tiny_actor_gradients_flag_actor_fp16_underflow(tmp_path, capsys):
    """The actor's loss scaled by 1e-12 (a real trainer, real engines): its gradients sit far below
    fp16's smallest normal at the default loss scale 2^11. Only the actor is flagged; the reward
    model here is an ordinary one. Where `auto` means fp16 (CUDA < 8.0) the advice is fp16 with the
    largest initial scale that does not overflow, and that block renders too."""
    from verl_ds.diagnostics.precision_report import advise, precision_block, safe_scale_power
    from verl_ds.programs.precision_advisor import debug_precision
    from verl_ds.trainer.rl_trainer import RLTrainer

    class TinyActorLoss(RLTrainer):
        def __init__(self, cfg):
            super().__init__(cfg)
            loss_fn = self.actor.micro_loss

            def micro_loss(mb, counts):  # planted: gradients 1e-12 of the real ones
                loss, metrics, out = loss_fn(mb, counts)
                return loss * 1e-12, metrics, out

            self.actor.micro_loss = micro_loss

    rm = _reward_dir(tmp_path, planted=False)
    ov = _overrides(tmp_path, rm)
    res = debug_precision(EXAMPLE, ov, 2, tmp_path / "advice", TinyActorLoss)
    with capsys.disabled():
        print(res["report"])
    recs = res["recommendations"]
    assert {r for r, a in recs.items() if a["flagged"]} == {"actor"}, res["report"]
    actor = recs["actor"]
    assert "underflow fp16 at loss scale 2^11" in actor["reason"]
    assert actor["dtype"] == "bf16" or (actor["dtype"] == "fp16" and actor["scale_power"] > 11)
    assert res["roles"]["actor"]["grad_max"] < 1e-9 < res["roles"]["critic"]["grad_max"]
    for role in ("critic", "reference", "reward"):
        assert recs[role]["dtype"] == "fp32" and "no range problem" in recs[role]["reason"]
    block = yaml.safe_load((tmp_path / "advice" / "precision.yaml").read_text())["precision"]
    assert block["actor_dtype"] == actor["dtype"]
    assert block["rollout_dtype"] == "auto"  # the rollout follows the actor: matched dtypes
    assert f"- rollout: auto: the actor's {actor['dtype']} " in res["report"]

    m = res["roles"]["actor"]
    old_gpu = {**recs, "actor": advise("actor", m, auto_dtype="fp16")}
    k = safe_scale_power(m)
    assert old_gpu["actor"]["dtype"] == "fp16" and old_gpu["actor"]["scale_power"] == k > 11
    assert old_gpu["actor"]["reason"].startswith(f"fp16 with initial_scale_power {k}: ")
    run = apply_overrides(read_yaml(EXAMPLE), ov)
    run["precision"].update(yaml.safe_load(precision_block(old_gpu))["precision"])
    capsys.readouterr()
    assert cli.main(["config", "render", "--config", write_yaml(tmp_path / "merged.yaml", run)]) == 0
    assert f'"initial_scale_power": {k}' in capsys.readouterr().out.split("# actor: DeepSpeed config")[1]


def test_bad_input_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:  # the argument parser's own one-line error
        cli.main(["debug", "precision", "--config", EXAMPLE, "--steps", "0"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: verl-ds debug precision: argument --steps: must be > 0, got 0"
    ]
    assert cli.main(["debug", "precision", "--config", EXAMPLE, "no.such_key=1"]) == 2
    assert capsys.readouterr().err.startswith("error: no")


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_vanish_fraction_counts_erased_differences(dtype):
    from verl_ds.programs.precision_advisor import vanish_fraction

    scores = torch.tensor([100.0, 100.01, 100.02, 1.0, 2.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    frac, pairs = vanish_fraction(scores, groups, dtype)
    assert pairs == 4 and frac == pytest.approx(3 / 4)  # 1.0 vs 2.0 survives; the three near 100 do not
