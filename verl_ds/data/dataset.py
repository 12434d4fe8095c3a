"""Tokenized prompts and a resumable sampler over them (the examples come from `tasks.load_examples`)."""

from __future__ import annotations

import logging
import random

from verl_ds.data.chat import ChatCodec
from verl_ds.dist import rank

log = logging.getLogger(__name__)


def tokenize_prompts(examples: list[dict], codec: ChatCodec, max_prompt_length: int) -> list[dict]:
    """Add `prompt_ids` to each example as `codec` writes it (its tokenizer; its chat template, system
    prompt and tools where it uses a template); over-long prompts keep their tail. Each distinct text is
    tokenized once, all in one batched call (the built-in task repeats a few prompts many times: one
    call a row was a visible share of every rank's start-up)."""
    distinct = list(dict.fromkeys(ex["prompt"] for ex in examples))
    texts = codec.prompt_texts(distinct)
    # a chat template already holds the special tokens; a plain prompt gets the tokenizer's own
    ids = codec.tok(texts, add_special_tokens=not codec.use_template)["input_ids"] if texts else []
    by_prompt = dict(zip(distinct, ids))
    long = sum(len(x) > max_prompt_length for x in ids)
    if long and rank() == 0:  # one line per dataset, not one per prompt or per rank
        log.warning(
            "data.max_prompt_length: %d of %d distinct prompts are longer than %d tokens and keep only their last %d",
            long,
            len(ids),
            max_prompt_length,
            max_prompt_length,
        )
    return [{**ex, "prompt_ids": by_prompt[ex["prompt"]][-max_prompt_length:]} for ex in examples]


class PromptSampler:
    """Epoch-wise shuffled indices with an explicit position, so a resumed run continues exactly."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._make_order()
            out.append(self._order[self.pos])
            self.pos += 1
        return out

    def draw(self, k: int, rank: int, world: int) -> list[int]:
        """This rank's share of the next `k` indices (every rank's sampler draws the same `k`)."""
        return self.next(k)[rank::world]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._make_order()
