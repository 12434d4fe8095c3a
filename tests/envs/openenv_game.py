"""A small OpenEnv environment written as OpenEnv's authors write them (its pydantic Action and
Observation, its `Environment` base), served by OpenEnv's own server in the tests."""

from __future__ import annotations

import random
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    text: str = ""


class GuessNumber(Environment[GuessAction, GuessObservation, State]):
    """Guess a number in 1..9 in 4 tries: 'higher'/'lower' hints, reward 1 for a hit."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state, self.target = State(step_count=0), 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self._state, self.target = State(episode_id=episode_id, step_count=0), random.Random(seed).randint(1, 9)
        return GuessObservation(text="Guess my number (1-9).", reward=0.0, done=False)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        digits = [c for c in action.message if c.isdigit()]
        last = self._state.step_count >= 4
        if not digits:
            return GuessObservation(text="No number there.", reward=0.0, done=last)
        guess = int(digits[-1])
        if guess == self.target:
            return GuessObservation(text="Right!", reward=1.0, done=True)
        return GuessObservation(text="higher" if guess < self.target else "lower", reward=0.0, done=last)

    @property
    def state(self) -> State:
        return self._state
