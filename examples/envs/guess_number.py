"""A complete multi-turn environment, as a user writes one (docs/ENVIRONMENTS.md).

The model guesses the example's answer (an integer); the environment answers "higher" or "lower"
as a user message until the guess is right or `max_guesses` guesses were made. Reward: 1 for the
right number, less for each extra guess. Use it with

    rollout:
      multi_turn:
        env: examples.envs.guess_number:GuessNumber      # importable from PYTHONPATH (the repo root)
        env_kwargs: {max_guesses: 4}
        max_turns: 4
    data:
      reward_fn: none                                    # the environment's reward alone

The environment sees and returns text only; verl-ds turns its observations into token ids.
"""

from __future__ import annotations

import re


class GuessNumber:
    observation_role = "user"  # a plain string observation is sent as this role (default: user)

    def __init__(self, max_guesses: int = 4, penalty: float = 0.2):
        self.max_guesses, self.penalty = max_guesses, penalty
        self.target, self.guesses = 0, 0

    def reset(self, example: dict):
        """Called once per episode with the dataset row; returning None keeps the prompt as it is (a
        string or messages returned here would open the conversation after the prompt)."""
        self.target, self.guesses = int(str(example["answer"]).strip()), 0
        return None

    def step(self, action: str):
        """The model's turn as text -> (observation or None, reward, done, info)."""
        self.guesses += 1
        numbers = re.findall(r"-?\d+", action)
        if not numbers:
            return "Answer with a number.", 0.0, self.guesses >= self.max_guesses, {"valid": 0.0}
        guess = int(numbers[-1])
        if guess == self.target:
            return None, max(0.0, 1.0 - self.penalty * (self.guesses - 1)), True, {"valid": 1.0}
        if self.guesses >= self.max_guesses:
            return None, 0.0, True, {"valid": 1.0}
        return ("higher" if guess < self.target else "lower"), 0.0, False, {"valid": 1.0}
