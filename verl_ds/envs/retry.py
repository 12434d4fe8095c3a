"""`rollout.multi_turn.env: retry`: a toy environment for the char-level arithmetic model.

The model answers; a wrong answer gets the observation `#` ("try again") until `max_tries`
answers were given. Reward 1 for a correct answer at try k is discounted to `discount ** (k-1)`.
Small enough to train in seconds; it exercises every part of the multi-turn path.
"""

from __future__ import annotations


class RetryEnv:
    def __init__(self, max_tries: int = 3, discount: float = 0.5, feedback: str = "#"):
        self.max_tries, self.discount, self.feedback = max_tries, discount, feedback
        self.answer, self.tries = "", 0

    def reset(self, example: dict):
        self.answer, self.tries = str(example["answer"]).strip(), 0
        return None  # the prompt is the first observation

    def step(self, action: str):
        self.tries += 1
        if action.strip() == self.answer:
            return None, self.discount ** (self.tries - 1), True, {"correct": 1.0}
        if self.tries >= self.max_tries:
            return None, 0.0, True, {"correct": 0.0}
        return self.feedback, 0.0, False, {"correct": 0.0}
