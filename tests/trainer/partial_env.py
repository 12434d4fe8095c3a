"""An environment whose observations depend on the episode's history (the try count): resuming its
episodes in flight is exact only if their environments come back in the state they were left in."""


class CountingRetry:
    def __init__(self, max_tries: int = 3):
        self.max_tries, self.answer, self.tries = max_tries, "", 0

    def reset(self, example: dict):
        self.answer, self.tries = str(example["answer"]).strip(), 0
        return None

    def step(self, action: str):
        self.tries += 1
        if action.strip() == self.answer:
            return None, 1.0 / self.tries, True, {}
        if self.tries >= self.max_tries:
            return None, 0.0, True, {}
        return f"#{self.tries}", 0.0, False, {}
