"""Oracles shared by the rollout tests: HF forward logprobs and free ports."""

import socket

import torch


def load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_response_logprobs(model, prompt, response, temperature=1.0):
    """Logprobs of `response` given `prompt` from one unpadded forward, after temperature
    (temperature 0: greedy, i.e. raw log-softmax)."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def max_logprob_diff(model, batch, temperature=1.0):
    """max |rollout logprob - HF logprob| over every response token of a RolloutBatch."""
    rows = batch.to_lists()
    worst = 0.0
    for p, r, lp in zip(rows["prompts"], rows["responses"], rows["logprobs"]):
        ref = hf_response_logprobs(model, p, r, temperature)
        worst = max(worst, (ref - torch.tensor(lp)).abs().max().item())
    return worst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROMPTS = [[1, 5, 6, 17, 7], [1, 9, 8, 17], [1, 4, 16, 4, 17, 5, 5], [1, 12]]
