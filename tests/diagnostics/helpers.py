"""Shared bits for the diagnostics tests: a tiny, fast run config and a Markdown table parser."""

from pathlib import Path

import yaml

DATA = Path(__file__).parent / "data"
LLAMA_8B = DATA / "llama3_8b_config.json"


FP32 = [f"precision.{k}_dtype=fp32" for k in ("actor", "critic", "reference", "rollout", "buffer")]


def tiny_overrides(run_dir) -> list[str]:
    """Tiny hidden-32 Llama, 4 prompts x 2 samples, HF rollout, no W&B; every dtype pinned to fp32
    (the tests assert fp32 byte counts; `auto` would follow the CPU kind)."""
    return FP32 + [
        "rollout.engine=hf",
        "trainer.prompts_per_step=4",
        "rollout.n=2",
        "rollout.max_new_tokens=3",
        "precision.buffer_dtype=fp32",
        "model.tiny.hidden=32",
        "model.tiny.ffn=64",
        "roles.actor.micro_batch_size=4",
        "roles.reference.micro_batch_size=8",
        "roles.critic.micro_batch_size=4",
        "logging.wandb.mode=disabled",
        f"trainer.run_dir={run_dir}",
    ]


def write_yaml(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def parse_md_tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table in `text` as rows of cells; asserts header, separator, equal widths."""
    tables, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in block]
            assert len(rows) >= 2, block
            assert all(set(c) <= set("-: ") and c for c in rows[1]), f"no separator row: {block[1]}"
            assert len({len(r) for r in rows}) == 1, f"unequal column counts: {block}"
            tables.append([rows[0]] + rows[2:])
            block = []
    return tables
