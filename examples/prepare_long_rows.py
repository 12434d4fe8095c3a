"""Long rows for the tiny char model: each prompt is ~`tokens` characters of solved sums (few-shot
context, one token a character) and then the question, `a+b=`; the answer is the sum. With
`examples/grpo_cpu_tiny_long_sp.yaml` every row holds ~8k tokens, trained split over 2 ranks.

    .venv/bin/python examples/prepare_long_rows.py runs/long_rows/train.jsonl      # 64 prompts of 8,192 tokens
    bash launch/train.sh examples/grpo_cpu_tiny_long_sp.yaml
"""

import argparse
import json
import random
from pathlib import Path


def write(path: Path, rows: int, tokens: int, max_value: int = 4, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(rows):
            shots = []
            while sum(len(s) + 1 for s in shots) < tokens - 8:
                a, b = rng.randint(0, max_value), rng.randint(0, max_value)
                shots.append(f"{a}+{b}={a + b}")
            a, b = rng.randint(0, max_value), rng.randint(0, max_value)
            question = f"{a}+{b}="
            context = " ".join(shots)[-(tokens - len(question) - 2) :]
            context = context[context.index(" ") + 1 :]  # from the first whole sum on
            f.write(json.dumps({"prompt": f"{context} {question}", "answer": str(a + b)}) + "\n")
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8192, help="characters (tokens) a prompt holds, about")
    a = ap.parse_args()
    print(write(a.out, a.rows, a.tokens))
