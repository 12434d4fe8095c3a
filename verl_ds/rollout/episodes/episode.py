"""The episode loop's typed hand-offs: how episodes are sampled (`Sampling`, `SeedKey`), bounded
(`TurnLimits`) and built (`EpisodeSpec`); an episode and its training rows (`Episode`, `Segment`);
and what a rollout hands the trainer (`Rollout`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from ..batch import RolloutBatch
from ..engines.remote import as_message
from .environment import Environment


@dataclass(frozen=True)
class Sampling:
    """How each episode's turns are sampled: `n` episodes per prompt, up to `max_new_tokens` a turn."""

    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    top_k: int = 0


class SeedKey(NamedTuple):
    """What a call's seeds derive from (`seeding.py`): the run's seed, the step (a string for
    validation, apart from every training step's) and the dynamic-sampling round."""

    run_seed: int
    step: int | str
    round_: int = 0


@dataclass(frozen=True)
class TurnLimits:
    """`rollout.multi_turn` limits. Tokens count the response region (model + environment tokens)."""

    max_turns: int = 1
    max_env_tokens: int = 0  # an observation's content is cut to this many tokens (0: no cut)
    max_total_tokens: int = 0  # model + environment tokens of a row (0: only max_model_len bounds it)
    max_model_len: int = 256  # prompt + response; an episode that would pass it ends truncated
    max_failure_fraction: float = 0.1  # of a call's episodes whose environment may raise before the run stops


SINGLE_TURN = TurnLimits(max_model_len=1 << 62)  # a single-turn episode: max_new_tokens alone bounds it


@dataclass(frozen=True)
class EpisodeSpec:
    """A multi-turn job's episodes, built once (`trainer.builder.build_episodes`); a single-turn job
    has none. `codec` is `data.chat.ChatCodec` (prompts and observations as ids; rollout imports no
    data); `strict`: check each row's ids against the one-shot template (`tokenization_check`)."""

    env_factory: Callable[[], Environment]
    codec: Any
    limits: TurnLimits = TurnLimits()
    strict: bool = True


@dataclass
class Segment:
    """One training row: a prompt and what followed it, with the conversation as text."""

    prompt_ids: list[int]
    messages: list[dict]
    ids: list[int] = field(default_factory=list)
    mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def add(self, ids: list[int], model: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [1.0 if model else 0.0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)


@dataclass
class Episode:
    group: int  # the prompt's index in this call
    sample: int  # 0 .. n-1
    env: Environment | None  # None: a single-turn episode (its one turn ends it)
    key: tuple = (0, 0)  # (step, global prompt position): what its seeds derive from
    segments: list[Segment] = field(default_factory=list)
    reward: float = 0.0  # the sum of the environment's step rewards
    turns: int = 0
    finish: str = "stop"  # stop | length
    last_action: list[int] = field(default_factory=list)
    tool_calls: float = 0.0
    tool_failures: float = 0.0
    live: bool = True
    failure: str = ""  # the exception the environment raised (the episode ended there)
    calls: int = 0  # engine requests sent for it (later requests' seeds count them)
    pending: Segment | None = None  # a model turn paused before its end (partial rollouts): ids, logprobs
    versions: list[int] = field(default_factory=list)  # per model token: the weights version that sampled it
    actions: list[str] = field(default_factory=list)  # the model's turns as the environment got them

    @property
    def seg(self) -> Segment:
        return self.segments[-1]


@dataclass
class Rollout:
    """What a rollout hands the trainer: the rows, and per row its episode's final answer (the
    text the task's reward function scores), the environment's reward, and the episode index."""

    batch: RolloutBatch
    final_ids: list[list[int]]
    env_rewards: torch.Tensor  # [rows] float32
    episode: torch.Tensor  # [rows] long: rows of one episode (forks) share it
    metrics: dict[str, float] = field(default_factory=dict)
    episodes: list[Episode] = field(default_factory=list)

    def to_message(self) -> dict:
        """Plain data for a rollout rank's bridge to its trainer rank (the rows as their tensors, the rest as
        lists a checkpoint's JSON can hold; the episodes' live state stays behind)."""
        return dict(
            batch=as_message(self.batch),
            final_ids=[list(f) for f in self.final_ids],
            env_rewards=self.env_rewards.tolist(),  # float32 -> Python float -> float32: exact
            episode=self.episode.tolist(),
            episode_metrics=dict(self.metrics),
        )

    @classmethod
    def from_message(cls, msg: dict) -> Rollout:
        """`to_message` undone, on the trainer rank."""
        rewards = torch.tensor(msg["env_rewards"], dtype=torch.float32)
        index = torch.tensor(msg["episode"], dtype=torch.long)
        return cls(RolloutBatch(**msg["batch"]), msg["final_ids"], rewards, index, msg["episode_metrics"])
