"""Episodes: the one rollout path. A single-turn job is the one-turn case of the same loop.

Token-in, token-out: each turn, every live episode of this rank goes to the engine in one call
with its context *as ids* (its prompt, the model's sampled ids, the environment's ids); the
trainer later trains on exactly those ids. An environment's observation becomes ids through the
`ChatCodec` (the chat template's delta after an assistant turn), never by re-rendering earlier turns.
Model tokens carry loss mask 1 and their rollout logprobs; environment tokens mask 0, logprob 0.
With a chat template a turn cut at its token budget ends the episode (it has no end-of-turn to
continue after); without one (plain text, e.g. the char-level model) the observation follows it.

Turn 0 samples the n episodes of each prompt in one request per prompt, seeded exactly as a
single-turn step (`prompt_seed`); later turns send one request per live episode, seeded from
(run seed, step, prompt position, sample, turn) (`turn_seed`): episodes stay independent of each
other, of the batch order and of the rank, and a resumed run draws the same episodes.

A template that rewrites history (one that renders earlier turns differently once later ones
exist) cannot be continued as ids: the episode forks, and continues as a new training row whose
prompt is the template's rendering of the conversation so far.
"""

from __future__ import annotations

import logging
from dataclasses import asdict

import torch

from verl_ds import dist as vdist
from verl_ds.errors import ConfigError, RunFailure

from ..batch import RolloutBatch
from ..engines.distributed import generate_distributed, prompt_positions
from ..engines.engine import RolloutEngine
from ..seeding import prompt_seed, prompt_seeds, turn_seed
from .environment import env_reset, env_step, observation_role
from .episode import SINGLE_TURN, Episode, EpisodeSpec, Rollout, Sampling, SeedKey, Segment, TurnLimits

log = logging.getLogger(__name__)


def collect(
    rollout: RolloutEngine,
    examples: list[dict],
    prompt_ids: list[list[int]],
    sampling: Sampling,
    seed: SeedKey,
    spec: EpisodeSpec | None = None,
    at: tuple[int, int] | None = None,
) -> Rollout:
    """`sampling.n` episodes per prompt on this rank. Without a `spec` every episode is one turn: the
    engine's batch is the rows, as it always was. `at`: the (rank, world) whose prompts these are, where a
    rollout rank apart runs them for a trainer rank (`trainer.rollout_ranks`); default this rank's.
    Collective within a tensor-parallel group."""
    n, max_new_tokens = sampling.n, sampling.max_new_tokens
    run_seed, step, round_ = seed
    positions = prompt_positions(len(prompt_ids), round_, *(at or ()))
    if spec is None:
        batch = generate_distributed(
            rollout,
            prompt_ids,
            n,
            sampling.temperature,
            sampling.top_p,
            max_new_tokens,
            run_seed,
            step,
            round_,
            seeds=prompt_seeds(run_seed, step, positions),
            top_k=sampling.top_k,
        )
        final = [row[: int(k)] for row, k in zip(batch.response_ids.tolist(), batch.response_mask.sum(1).tolist())]
        return Rollout(batch, final, torch.zeros(len(batch)), torch.arange(len(batch)))
    episodes, batched = start_episodes(examples, prompt_ids, n, spec, [(step, p) for p in positions])
    tp = rollout.tp
    if tp > 1:  # a tensor-parallel group's members must send the same kind of request
        batched = vdist.all_reduce_min(float(batched)) > 0
    first = True
    while True:
        live = [ep for ep in episodes if ep.live]
        if tp > 1:  # every member of a tensor-parallel group generates until the whole group is done
            if vdist.all_reduce_max(float(len(live))) == 0:
                break
        elif not live:
            break
        advance(rollout, live, sampling, run_seed, spec, batched=first and batched)
        first = False
    check_failures(episodes, spec.limits)
    return assemble(episodes, spec.codec, rollout.pad_id, spec.strict)


def asked_for(prompt_ids: list[list[int]], sampling: Sampling, seed: SeedKey) -> dict:
    """What a trainer rank asks its rollout rank's episodes for (`trainer.rollout_ranks`), and what the answer
    carries: the prompts, how they are sampled and the seeds' key, as plain data."""
    return dict(prompts=[list(p) for p in prompt_ids], **asdict(sampling), seed=list(seed))


def collect_remote(remote, examples: list[dict], sampling: Sampling, seed: SeedKey) -> Rollout:
    """The episodes of `examples` that this trainer rank's rollout rank ran (`collect` there, at this rank's
    prompt positions: `trainer/rollout_rank.py`), taken off the stream by `remote` (a `RemoteRollout`)."""
    return Rollout.from_message(remote.answer(asked_for([e["prompt_ids"] for e in examples], sampling, seed)))


def start_episodes(
    examples: list[dict], prompt_ids: list[list[int]], n: int, spec: EpisodeSpec | None, keys
) -> tuple[list[Episode], bool]:
    """`n` episodes per prompt, contiguous per prompt, each reset (its environment may open the
    conversation: a prompt of its own); `keys[g]`: prompt g's (step, position). `spec` None:
    single-turn episodes (no environment). -> (the episodes, whether every one starts from its
    prompt as given: then their first call can be one request per prompt)."""
    episodes = [
        Episode(group=g, sample=j, env=spec.env_factory() if spec else None, key=tuple(keys[g]))
        for g in range(len(prompt_ids))
        for j in range(n)
    ]
    batched = True
    for ep in episodes:
        ex = examples[ep.group]
        if spec is None:
            ep.segments.append(Segment(list(prompt_ids[ep.group]), []))
            continue
        codec = spec.codec
        ep.segments.append(Segment(list(prompt_ids[ep.group]), codec.prompt_messages(ex["prompt"])))
        first = _guarded(ep, "reset", env_reset, ex)
        if first is not None:  # the environment opens the conversation: a prompt of its own
            msgs = _messages(first, "user")
            seg = ep.seg
            seg.messages += msgs
            seg.prompt_ids = (
                codec.render_ids(seg.messages, add_generation_prompt=True)
                if codec.use_template
                else seg.prompt_ids + codec.observation_ids(msgs)
            )
            batched = False
    return episodes, batched


def advance(
    rollout: RolloutEngine,
    live: list[Episode],
    sampling: Sampling,
    run_seed: int,
    spec: EpisodeSpec | None,
    batched: bool = False,
    cap: int | None = None,
    version: int = 0,
) -> int:
    """One engine call for the `live` episodes: each generates up to the rest of its turn's budget,
    or `cap` tokens (partial rollouts: the turn pauses there, kept in `ep.pending`, and continues at
    the next call). A finished turn goes to the environment (`_act`). `batched`: every episode's
    first call, n per prompt in one request per prompt (the episodes of a prompt contiguous).
    `version` tags the sampled tokens. Collective within a tensor-parallel group. -> the call's
    decode steps (its longest new output: what a decode-bound GPU engine's time follows)."""
    n, max_new_tokens = sampling.n, sampling.max_new_tokens
    limits = spec.limits if spec else SINGLE_TURN
    budgets = [_budget(ep, max_new_tokens, limits) for ep in live]
    asks = [b if cap is None else min(b, cap) for b in budgets]
    kw = dict(
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, run_seed=run_seed, step=None
    )
    if batched:
        heads = live[::n]
        seeds = [prompt_seed(run_seed, *ep.key) for ep in heads]
        new_tokens = max_new_tokens if cap is None else min(cap, max_new_tokens)
        prompts = [ep.seg.prompt_ids for ep in heads]
        out = generate_distributed(rollout, prompts, n, max_new_tokens=new_tokens, seeds=seeds, **kw)
    else:
        reqs = [request(ep, sampling, run_seed, spec) for ep in live]
        contexts, seeds = [r[0] for r in reqs], [r[2] for r in reqs]
        new_tokens = max(asks, default=1)
        if rollout.tp > 1:  # the group's members send identical requests, token limit included
            new_tokens = int(vdist.all_reduce_max(float(new_tokens)))
        out = generate_distributed(rollout, contexts, 1, max_new_tokens=new_tokens, seeds=seeds, **kw)
    rows = out.to_lists()
    steps = max((len(ids) for ids in rows["responses"]), default=0)
    for ep, budget, ask, ids, lps, reason in zip(
        live, budgets, asks, rows["responses"], rows["logprobs"], rows["finish_reasons"]
    ):
        if len(ids) > ask:  # this episode's own limit (the call ran to the largest one)
            ids, lps, reason = ids[:ask], lps[:ask], "length"
        paused = cap is not None and reason != "stop" and len(ids) < budget  # the turn goes on next call
        take(ep, ids, lps, reason, paused, version, spec)
    return steps


def take(
    ep: Episode, ids: list[int], lps: list[float], reason: str, paused: bool, version: int, spec: EpisodeSpec | None
) -> None:
    """One engine request's output for `ep`, its tokens tagged with `version`: `paused` keeps the turn
    in `ep.pending` (partial rollouts: it goes on at the next request); otherwise the turn ends, with
    it a single-turn episode, and a multi-turn one's goes to the environment (`_act`)."""
    ep.calls += 1
    ep.versions += [version] * len(ids)
    turn = ep.pending or Segment([], [])
    turn.add(ids, model=True, logprobs=lps)
    if paused:
        ep.pending = turn
        return
    ep.pending = None
    finish = "stop" if reason == "stop" else "length"
    if spec is None:  # a single-turn episode: its one turn ends it
        ep.seg.add(turn.ids, model=True, logprobs=turn.logprobs)
        ep.last_action, ep.finish, ep.turns, ep.live = turn.ids, finish, 1, False
    else:
        _act(ep, turn.ids, turn.logprobs, finish, spec.codec, spec.limits)


def request(ep: Episode, sampling: Sampling, run_seed: int, spec: EpisodeSpec | None) -> tuple[list[int], int, int]:
    """`ep`'s next engine request as one sample: (its context as ids, the new tokens it may still
    generate this turn, its seed from (run seed, step, position, sample, requests sent so far))."""
    context = ep.seg.prompt_ids + ep.seg.ids + (ep.pending.ids if ep.pending else [])
    budget = _budget(ep, sampling.max_new_tokens, spec.limits if spec else SINGLE_TURN)
    return context, budget, turn_seed(run_seed, *ep.key, ep.sample, ep.calls)


def _guarded(ep: Episode, method: str, call, arg):
    """`call(ep.env, arg)` (`env_reset` / `env_step`: the contract checked where it is crossed). A
    contract mistake is the environment author's, one line (ConfigError); an exception raised inside
    the environment ends only this episode: recorded in `ep.failure`, logged with its traceback,
    counted in `env/failures` (the run stops when a call's count passes `max_failure_fraction`)."""
    try:
        return call(ep.env, arg)
    except ConfigError:
        raise
    except Exception as e:
        ep.failure = f"{type(ep.env).__name__}.{method}() raised {type(e).__name__}: {e}"
        log.warning("environment failure (the episode ends, counted in env/failures): %s", ep.failure, exc_info=e)
        return None


def check_failures(episodes: list[Episode], limits: TurnLimits) -> None:
    """Stop the run in one line when more than `max_failure_fraction` of the episodes' environments
    raised (a broken environment, not an unlucky episode)."""
    failed = [ep.failure for ep in episodes if ep.failure]
    if failed and len(failed) > limits.max_failure_fraction * len(episodes):
        raise RunFailure(
            f"{len(failed)} of {len(episodes)} episodes ended in an exception of their environment "
            f"(> rollout.multi_turn.max_env_failure_fraction {limits.max_failure_fraction}); the first: {failed[0]}"
        )


def _budget(ep: Episode, max_new_tokens: int, limits: TurnLimits) -> int:
    """New tokens this episode may still generate this turn (at least 1; the limits are checked
    before an episode continues)."""
    seg, done = ep.seg, len(ep.pending.ids) if ep.pending else 0  # done: a paused turn's tokens so far
    room = [max_new_tokens - done, limits.max_model_len - len(seg.prompt_ids) - len(seg.ids) - done]
    if limits.max_total_tokens:
        room.append(limits.max_total_tokens - len(seg.ids) - done)
    return max(1, min(room))


def _messages(obs, role: str) -> list[dict]:
    return [{"role": role, "content": obs}] if isinstance(obs, str) else [dict(m) for m in obs]


def _act(ep: Episode, ids: list[int], lps: list[float], reason: str, codec, limits: TurnLimits) -> None:
    """The model's turn: append it, let the environment answer, append the answer (or end)."""
    seg = ep.seg
    seg.add(ids, model=True, logprobs=lps)
    ep.turns += 1
    ep.last_action = ids
    text = codec.action_text(ids)
    ep.actions.append(text)
    seg.messages.append({"role": "assistant", "content": text})
    ep.finish = reason
    if reason == "length" and codec.use_template:  # cut mid-turn: no end-of-turn token to continue after
        ep.live = False
        return
    out = _guarded(ep, "step", env_step, text)
    if out is None:  # the environment raised: the episode ends here, counted
        ep.live = False
        return
    obs, reward, done, info = out
    ep.reward += reward
    ep.tool_calls += float(info.get("tool_calls", 0.0))
    ep.tool_failures += float(info.get("tool_failures", 0.0))
    if done or obs is None or ep.turns >= limits.max_turns:
        ep.live = False
        return
    msgs = _messages(obs, observation_role(ep.env))  # a string: one message of that role
    if limits.max_env_tokens:
        for m in msgs:
            ids_ = codec.content_ids(m["content"])
            if len(ids_) > limits.max_env_tokens:
                m["content"] = codec.decode(ids_[: limits.max_env_tokens])
    if codec.extends(seg.messages, seg.messages + msgs):
        delta = codec.observation_ids(msgs)
        used, total = len(seg.ids) + len(delta), len(seg.prompt_ids) + len(seg.ids) + len(delta)
        if total >= limits.max_model_len or (limits.max_total_tokens and used >= limits.max_total_tokens):
            ep.finish, ep.live = "length", False  # no room left for another model turn
            return
        seg.add(delta, model=False)
        seg.messages += msgs
    else:  # the template rewrote history: continue as a new row
        messages = seg.messages + msgs
        prompt = codec.render_ids(messages, add_generation_prompt=True)
        if len(prompt) >= limits.max_model_len:
            ep.finish, ep.live = "length", False
            return
        ep.segments.append(Segment(prompt, messages))


def assemble(episodes: list[Episode], codec, pad_id: int, strict: bool) -> Rollout:
    """Episodes -> the `Rollout` the trainer takes: one row per segment, the episode's metrics;
    `strict`: count rows whose ids differ from the one-shot template rendering."""
    lists = dict(prompts=[], responses=[], logprobs=[], finish_reasons=[], group_ids=[], loss_masks=[])
    final, env_r, index, mismatched, checked = [], [], [], 0, 0
    for e, ep in enumerate(episodes):
        for k, seg in enumerate(ep.segments):
            lists["prompts"].append(seg.prompt_ids)
            lists["responses"].append(seg.ids)
            lists["logprobs"].append(seg.logprobs)
            lists["loss_masks"].append(seg.mask)
            lists["finish_reasons"].append(ep.finish if k == len(ep.segments) - 1 else "stop")
            lists["group_ids"].append(ep.group)
            final.append(ep.last_action)
            env_r.append(ep.reward)
            index.append(e)
            if strict and seg.ids:
                checked += 1
                cut = k == len(ep.segments) - 1 and ep.finish == "length"
                mismatched += not codec.matches_one_shot(seg.prompt_ids, seg.messages, seg.ids, cut)
    batch = RolloutBatch.from_lists(**lists, pad_id=pad_id)
    n_ep = max(len(episodes), 1)
    turns = [ep.turns for ep in episodes] or [0]
    model_tok = batch.loss_mask.sum(1)
    metrics = {
        "multi_turn/turns/mean": sum(turns) / n_ep,
        "multi_turn/turns/max": float(max(turns)),
        "multi_turn/forks": float(sum(len(ep.segments) - 1 for ep in episodes)),
        "tools/call_frequency": sum(ep.tool_calls for ep in episodes) / max(sum(turns), 1),
        "tools/failure_frequency": sum(ep.tool_failures for ep in episodes)
        / max(sum(ep.tool_calls for ep in episodes), 1.0),
        "env/failures": float(sum(bool(ep.failure) for ep in episodes)),
        "response/model_tokens/mean": float(model_tok.mean()) if len(batch) else 0.0,
        "response/env_tokens/mean": float((batch.response_mask.sum(1) - model_tok).mean()) if len(batch) else 0.0,
    }
    if strict:
        metrics["multi_turn/token_mismatch_fraction"] = mismatched / max(checked, 1)
    return Rollout(
        batch, final, torch.tensor(env_r, dtype=torch.float32), torch.tensor(index, dtype=torch.long), metrics, episodes
    )
