"""Packed rows (padding-free, one sequence per micro-batch with per-row positions and attention kept
inside each row) against padded rows under the same token budget, on CPU: which is faster for the
update's forward + backward. Prints a Markdown table of ratios measured in one run.

    source launch/env.sh && python benchmarks/packing_cpu.py
    python benchmarks/packing_cpu.py --budgets 256 1024 --repeats 3

The model is SmolLM2-135M-Instruct (made by `bash launch/demo.sh` once), fp32, SDPA attention, as the
demo's actor runs it. The rows: 64 (8 prompts x 8 answers), prompt lengths 50-80 tokens shared by a
prompt's 8 rows, answer lengths long-tailed (lognormal, median ~14, capped at 96: the demo's job with
`max_new_tokens` 96 measured mean 17.6). Both cells order the rows by length and cut them into
micro-batches under the budget: padded rows (what `max_tokens_per_micro_batch` does: each
micro-batch runs its longest row x its rows) or packed (every row's real tokens in one sequence;
transformers builds the block-diagonal causal mask from the restarting position ids). The loss is
each answer token's log-probability, so both run the LM head on the same tokens. Cells alternate
per repeat. Also printed: the largest logprob gap between the two (fp32: float noise).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from demo_job import ROOT, require_model
from transformers import AutoModelForCausalLM


def make_rows(seed: int) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, answer length) per row."""
    rng = random.Random(seed)
    rows = []
    for _ in range(8):
        prompt = [rng.randrange(100, 49000) for _ in range(rng.randint(50, 80))]
        for _ in range(8):
            n = max(1, min(96, int(rng.lognormvariate(2.65, 0.75))))
            rows.append((prompt + [rng.randrange(100, 49000) for _ in range(n)], n))
    return rows


def run_tokens(rows, idx: list[int], packed: bool) -> int:
    """The tokens a micro-batch's forward runs: its rows' real tokens packed, else rows x the longest."""
    lengths = [len(rows[i][0]) for i in idx]
    return sum(lengths) if packed else len(lengths) * max(lengths)


def micro_batches(rows, budget: int, packed: bool) -> list[list[int]]:
    """Row indices by length, cut where the next row would pass the budget (padded: rows x longest)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    out, cur = [], []
    for i in order:
        cand = cur + [i]
        if cur and run_tokens(rows, cand, packed) > budget:
            out.append(cur)
            cand = [i]
        cur = cand
    return out + [cur]


def padded_logprobs(model, rows, idx) -> list[torch.Tensor]:
    width = max(len(rows[i][0]) for i in idx)
    ids = torch.zeros(len(idx), width, dtype=torch.long)
    mask = torch.zeros(len(idx), width, dtype=torch.long)
    for r, i in enumerate(idx):
        ids[r, : len(rows[i][0])] = torch.tensor(rows[i][0])
        mask[r, : len(rows[i][0])] = 1
    hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    out = []
    for r, i in enumerate(idx):
        seq, n = rows[i]
        out.append(_answer_logprobs(model, hidden[r, len(seq) - n - 1 : len(seq) - 1], seq[len(seq) - n :]))
    return out


def packed_logprobs(model, rows, idx) -> list[torch.Tensor]:
    ids = torch.tensor([t for i in idx for t in rows[i][0]])[None]
    pos = torch.tensor([p for i in idx for p in range(len(rows[i][0]))])[None]
    hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
    out, start = [], 0
    for i in idx:
        seq, n = rows[i]
        end = start + len(seq)
        out.append(_answer_logprobs(model, hidden[end - n - 1 : end - 1], seq[len(seq) - n :]))
        start = end
    return out


def _answer_logprobs(model, hidden, targets) -> torch.Tensor:
    logits = model.lm_head(hidden).float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]


def run(model, rows, budget: int, packed: bool) -> tuple[float, float, int, list[torch.Tensor]]:
    """One update pass (forward + backward per micro-batch) -> (seconds, padding efficiency,
    micro-batches, the logprobs by row)."""
    fn = packed_logprobs if packed else padded_logprobs
    mbs = micro_batches(rows, budget, packed)
    real = sum(len(s) for s, _ in rows)
    ran = sum(run_tokens(rows, g, packed) for g in mbs)
    lps: dict[int, torch.Tensor] = {}
    t0 = time.perf_counter()
    for g in mbs:
        out = fn(model, rows, g)
        torch.stack([x.sum() for x in out]).sum().backward()
        lps.update({i: x.detach() for i, x in zip(g, out)})
    secs = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return secs, real / ran, len(mbs), [lps[i] for i in range(len(rows))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    require_model()
    model = AutoModelForCausalLM.from_pretrained(
        str(ROOT / "runs/smollm2-135m-instruct"), dtype=torch.float32, attn_implementation="sdpa"
    ).train()
    rows = make_rows(args.seed)
    run(model, rows, 512, False)  # warm-up
    print(f"rows {len(rows)}, tokens {sum(len(s) for s, _ in rows)}, answer tokens {sum(n for _, n in rows)}")
    print(
        "| budget | padded s | packed s | packed / padded | padding eff. (padded) "
        "| micro-batches padded / packed | max logprob gap |"
    )
    print("|---|---|---|---|---|---|---|")
    for budget in args.budgets:
        times: dict[bool, list[float]] = {False: [], True: []}
        out: dict[bool, tuple] = {}
        for _ in range(args.repeats):
            for packed in (False, True):
                secs, eff, n, lps = run(model, rows, budget, packed)
                times[packed].append(secs)
                out[packed] = (eff, n, lps)
        (eff_pad, n_pad, ref), (_, n_pack, lps) = out[False], out[True]
        gap = max(float((a - b).abs().max()) for a, b in zip(lps, ref))
        pad, pack = statistics.median(times[False]), statistics.median(times[True])
        cells = [budget, f"{pad:.2f}", f"{pack:.2f}", f"{pack / pad:.2f}", f"{eff_pad:.2f}", f"{n_pad} / {n_pack}"]
        print("| " + " | ".join(map(str, cells)) + f" | {gap:.1e} |")


if __name__ == "__main__":
    main()
