"""Oracles shared by the rollout tests: HF forward logprobs and free ports."""

import socket

import torch


def load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_response_logprobs(model, prompt, response, temperature=1.0, top_k=0, top_p=1.0):
    """Logprobs of `response` given `prompt` from one unpadded forward, after temperature and the
    top-k/top-p set renormalised (`algos.processed_logprobs`; temperature 0: the raw log-softmax)."""
    from verl_ds.algos import TokenDist, processed_logprobs

    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    lp = processed_logprobs(logits, TokenDist(temperature, top_k, top_p))
    return lp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def max_logprob_diff(model, batch, temperature=1.0, top_k=0, top_p=1.0):
    """max |rollout logprob - HF logprob| over every response token of a RolloutBatch."""
    rows = batch.to_lists()
    worst = 0.0
    for p, r, lp in zip(rows["prompts"], rows["responses"], rows["logprobs"]):
        ref = hf_response_logprobs(model, p, r, temperature, top_k, top_p)
        worst = max(worst, (ref - torch.tensor(lp)).abs().max().item())
    return worst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROMPTS = [[1, 5, 6, 17, 7], [1, 9, 8, 17], [1, 4, 16, 4, 17, 5, 5], [1, 12]]
