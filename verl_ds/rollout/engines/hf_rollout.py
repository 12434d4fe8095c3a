"""`HFRollout`: the same interface on `transformers.generate` — the fallback when vLLM is absent
and the baseline the benchmark compares vLLM against."""

from __future__ import annotations

import time
from typing import Iterable

import torch

from verl_ds.algos import TokenDist, processed_logprobs, use_fp32_lm_head
from verl_ds.errors import RunFailure
from verl_ds.precision import TORCH_DTYPES

from ..batch import RolloutBatch
from ..seeding import chunk_seed
from .engine import Sampled
from .weights import ParamChecker, eos_token_ids, fingerprint, pad_token_id, sync_mismatch


def inverse_cdf_sample(logprobs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row from `logprobs` [B, V] with the row's own uniform draw `u` [B] in [0, 1):
    the first token whose cumulative probability exceeds u (zero-probability tokens never win)."""
    cdf = logprobs.double().exp().cumsum(-1)
    tok = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return torch.minimum(tok, (cdf < cdf[:, -1:]).sum(-1))  # rounding at u ~ 1: the last nonzero token


class _SampledLogprobs:
    """A `generate` logits processor, first in the custom list, that keeps per generated token only
    the processed logprob (`processed_logprobs`) of the token `generate` picked: O(B·T) memory, where
    `output_logits` held every step's [B, V] logits. The token picked at step t is only known at step
    t + 1 (the last column of its `input_ids`), so one step's [B, V] log-probs wait for it; `finish`
    takes the last step's token from the returned sequences. It reads the scores as they reach the
    custom processors: the model's logits (after any processor the model's generation_config adds,
    such as a repetition penalty), before the sampling ones (HF's temperature/top-p, `_PromptStreams`)."""

    def __init__(self, dist: TokenDist):
        self.dist = dist
        self.pending: torch.Tensor | None = None  # [B, V] the latest step's log-probs, its token not yet known
        self.taken: list[torch.Tensor] = []  # [B] per step whose token is known

    def record(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.taken.append(self.pending.gather(1, input_ids[:, -1:]).squeeze(1))
        self.pending = processed_logprobs(scores, self.dist)
        return self.pending

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.record(input_ids, scores)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] logprobs of `new_tokens` [B, T], the generated columns of `sequences` (a `generate`
        that ran a step past the end, as its deferred stop check may, recorded more: cut to T)."""
        t = new_tokens.shape[1]
        if len(self.taken) < t:
            self.taken.append(self.pending.gather(1, new_tokens[:, -1:]).squeeze(1))
        self.pending = None
        return torch.stack(self.taken[:t], dim=1)


class _PromptStreams(_SampledLogprobs):
    """`_SampledLogprobs` that also samples every row from its prompt's own random stream:
    `uniforms` [B, T] holds row b's draw for each new token t (drawn up front, per prompt, from that
    prompt's seed), so a prompt's samples do not depend on the other prompts of the call, the
    rank that drew them or the batch order (vLLM's per-request seeds give the same property). It
    returns the chosen token as the only finite score: `generate` runs greedy and takes it."""

    def __init__(self, uniforms: torch.Tensor, dist: TokenDist):
        super().__init__(dist)
        self.u, self.t = uniforms, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        tok = inverse_cdf_sample(self.record(input_ids, scores), self.u[:, self.t])
        self.t += 1
        return torch.full_like(scores, float("-inf")).scatter_(1, tok.unsqueeze(-1), 0.0)


class HFRollout:
    tp = 1  # one model per rank

    def __init__(
        self,
        model_path: str,
        dtype: str = "fp32",
        device: str = "cpu",
        trust_remote_code: bool = False,
        lm_head_fp32: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        self.model_path, self.device, self.dtype = str(model_path), device, dtype
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=TORCH_DTYPES[self.dtype], trust_remote_code=trust_remote_code
            )
            .to(device)
            .eval()
        )
        if lm_head_fp32:
            use_fp32_lm_head(self.model)
        self.checker = ParamChecker(model_path)
        self.version = 0  # syncs begun (named in the check's line)
        self.eos_ids = eos_token_ids(model_path)
        self.pad_id = pad_token_id(model_path)
        self.start_s = 0.0
        self.last_metrics: dict[str, float] = {}

    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 16,
        seeds: list[int] | None = None,
        top_k: int = 0,
    ) -> RolloutBatch:
        """Left-padded batched `generate`; responses end at (and include) the first eos. With `seeds`,
        prompt i's n samples come from a stream seeded with seeds[i] alone (see `_PromptStreams`);
        None: `generate`'s own sampling from the global RNG."""
        from transformers import LogitsProcessorList

        prompts = [list(map(int, p)) for p in prompt_token_ids for _ in range(n)]
        groups = [i for i in range(len(prompt_token_ids)) for _ in range(n)]
        if not prompts:
            return RolloutBatch.from_lists([], [], [], [], [], pad_id=self.pad_id)
        padded = RolloutBatch.from_lists(
            prompts, [[]] * len(prompts), [[]] * len(prompts), [""] * len(prompts), groups, pad_id=self.pad_id
        )
        t0 = time.perf_counter()
        dist = TokenDist(temperature, top_k, top_p)
        sample_kw, record = {"do_sample": False}, _SampledLogprobs(dist)  # greedy
        if temperature > 0 and seeds is None:
            sample_kw = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}
        elif temperature > 0:
            u = torch.cat(
                [
                    torch.rand(n, max_new_tokens, generator=torch.Generator().manual_seed(int(s)), dtype=torch.float64)
                    for s in seeds
                ]
            )
            record = _PromptStreams(u.to(self.device), dist)
        out = self.model.generate(
            input_ids=padded.prompt_ids.to(self.device),
            attention_mask=padded.attention_mask.to(self.device),
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            logits_processor=LogitsProcessorList([record]),
            **sample_kw,
        )
        dt = time.perf_counter() - t0
        new_tokens = out[:, padded.prompt_ids.shape[1] :]  # [B, T]
        lp = record.finish(new_tokens).cpu()
        seq = new_tokens.cpu()
        responses, logprobs, reasons = [], [], []
        eos = torch.as_tensor(self.eos_ids)
        for i in range(len(prompts)):
            hits = torch.isin(seq[i], eos).nonzero()
            end = int(hits[0]) + 1 if len(hits) else seq.shape[1]
            responses.append(seq[i, :end].tolist())
            logprobs.append(lp[i, :end].tolist())
            reasons.append("stop" if len(hits) else "length")
        batch = RolloutBatch.from_lists(prompts, responses, logprobs, reasons, groups, pad_id=self.pad_id)
        ntok = float(batch.response_mask.sum())
        self.last_metrics = {"timing_s/gen": dt, "perf/rollout_tokens_per_s": ntok / max(dt, 1e-9)}
        return batch

    def stream(self, temperature: float, top_p: float, chunk_tokens: int, top_k: int = 0) -> ChunkedStream:
        """`generate` in chunks of `chunk_tokens` (HF generate keeps no KV cache between calls)."""
        return ChunkedStream(self, temperature, top_p, chunk_tokens, top_k)

    @torch.no_grad()
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Copy new weights in place. Each tensor is checked before it is copied, so a bad name or
        shape raises ValueError (tensors already copied stay copied; the model keeps serving)."""
        t0 = time.perf_counter()
        state = self.model.state_dict()
        self.version += 1
        want, check_s = {}, 0.0
        self.checker.begin()
        for name, tensor in named_tensors:
            if self.checker.check(name, tensor):
                cast = tensor.detach().to(state[name].device, state[name].dtype)
                t = time.perf_counter()
                want[name] = fingerprint(cast)
                check_s += time.perf_counter() - t
                state[name].copy_(cast)
        self.checker.finish()
        t = time.perf_counter()  # read back from the module that generates (as VLLMRollout does)
        live = dict(self.model.named_parameters())
        got = {n: fingerprint(live[n]) for n in want if n in live}
        if problem := sync_mismatch(self.version, self.version, got, want):  # one process: no stale version
            raise RunFailure(f"weight sync: {problem}")
        return {
            "timing_s/update_weights": time.perf_counter() - t0,
            "timing_s/sync_check": check_s + time.perf_counter() - t,
            "rollout/sync_checked_params": float(len(want)),
        }

    def sleep(self, level: int) -> None:  # nothing to free: HF generate holds no cache between calls
        pass

    def wake_up(self) -> None:  # nothing was freed
        pass

    def shutdown(self, release: bool = True) -> None:
        self.model = None


class _Request:
    """A stream request: `keys` samples of `context`; `got` one per sample once it has begun."""

    def __init__(self, keys: list, context: list[int], budget: int, seed: int):
        self.keys, self.context, self.budget, self.seed = keys, context, budget, seed
        self.got = [Sampled(k, [], [], "") for k in keys]


class ChunkedStream:
    """A `TokenStream` over `generate`: each step runs up to `chunk` new tokens of every running sample
    and re-sends its context (its KV recomputed). A request's samples start in one call seeded as
    `generate` seeds a prompt's n samples; a sample continues seeded by `chunk_seed`. Per step, one
    call per kind of request (new requests of k samples; samples going on)."""

    def __init__(self, engine: HFRollout, temperature: float, top_p: float, chunk: int, top_k: int = 0):
        self.engine, self.temperature, self.top_p, self.chunk = engine, temperature, top_p, max(1, chunk)
        self.top_k = top_k
        self.new: list[_Request] = []
        self.going: list[tuple[_Request, int]] = []  # (request, sample)
        self.steps, self.peak, self.seconds, self.tokens = 0, 0, 0.0, 0

    def add(self, keys: list, context: list[int], max_new_tokens: int, seed: int) -> None:
        self.new.append(_Request(list(keys), list(map(int, context)), max_new_tokens, int(seed)))
        self.peak = max(self.peak, len(self))

    def step(self) -> list[Sampled]:
        calls = {}  # one call per kind: k samples of new requests; 0 = samples going on
        for req in self.new:
            calls.setdefault(len(req.keys), []).extend((req, j) for j in range(len(req.keys)))
        if self.going:
            calls[0] = self.going
        self.new, self.going, ended = [], [], []
        for k, samples in calls.items():
            if k:  # new requests: their k samples from one prompt each
                reqs = [r for r, _ in samples[::k]]
                prompts, seeds = [r.context for r in reqs], [r.seed for r in reqs]
                budget = max(r.budget for r in reqs)
            else:
                prompts = [r.context + r.got[j].ids for r, j in samples]
                seeds = [chunk_seed(r.seed + j, len(r.got[j].ids)) for r, j in samples]
                budget = max(r.budget - len(r.got[j].ids) for r, j in samples)
            out = self.engine.generate(
                prompts, max(k, 1), self.temperature, self.top_p, min(self.chunk, budget), seeds, self.top_k
            ).to_lists()
            self.seconds += self.engine.last_metrics["timing_s/gen"]
            self.steps += max((len(r) for r in out["responses"]), default=0)
            for (req, j), ids, lps, reason in zip(samples, out["responses"], out["logprobs"], out["finish_reasons"]):
                got, room = req.got[j], req.budget - len(req.got[j].ids)
                ids, lps = ids[:room], lps[:room]  # this sample's own budget (the call ran to the largest)
                got.ids += ids
                got.logprobs += lps
                self.tokens += len(ids)
                if reason == "stop" and ids and ids[-1] in self.engine.eos_ids:  # (not cut off by the budget)
                    got.finish = "stop"
                elif len(got.ids) >= req.budget:
                    got.finish = "length"
                if got.finish:
                    ended.append(got)
                else:
                    self.going.append((req, j))
        return ended

    def close(self) -> list[Sampled]:
        cut = [r.got[j] for r, j in self.going] + [g for r in self.new for g in r.got]
        for got in cut:
            got.finish = "abort"
        self.new, self.going = [], []
        self.engine.last_metrics = {
            "timing_s/gen": self.seconds,
            "perf/rollout_tokens_per_s": self.tokens / max(self.seconds, 1e-9),
        }
        return cut

    def __len__(self) -> int:
        return sum(len(r.keys) for r in self.new) + len(self.going)
