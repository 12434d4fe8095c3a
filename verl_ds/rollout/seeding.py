"""The sampling-seed contract: no two samples of one run share a random stream.

vLLM seeds sample j of a request with `seed + j`, so seeds like `base + i` (prompt i) or
`base + step` overlap across prompts and steps (52 of 64 samples were duplicates, measured). Each
prompt's seed is instead a 62-bit hash of (run seed, step, global prompt position): streams
`seed .. seed + n - 1` of two prompts overlap with probability ~n / 2^62. The same run seed
reproduces the run, and a resumed run (which restores `step`) draws the same samples.
"""

from __future__ import annotations

import hashlib

_MASK = (1 << 62) - 1


def prompt_seed(run_seed: int, step: int | str, position: int) -> int:
    """The seed of the prompt at global `position` of `step`'s batch (positions are unique per step,
    across ranks: a repeated prompt at two positions gets two streams)."""
    digest = hashlib.blake2b(f"{run_seed}:{step}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def prompt_seeds(run_seed: int, step: int | str, positions) -> list[int]:
    return [prompt_seed(run_seed, step, int(p)) for p in positions]


def turn_seed(run_seed: int, step: int | str, position: int, sample: int, turn: int) -> int:
    """The seed of a multi-turn episode's later turn (turn >= 1): sample `sample` of the prompt at
    `position`. Turn 0 samples all n of a prompt from `prompt_seed`, as a single-turn step does, so
    a single-turn job draws exactly what it drew before multi-turn existed."""
    digest = hashlib.blake2b(f"{run_seed}:{step}:{position}:{sample}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def chunk_seed(seed: int, done: int) -> int:
    """The seed of a sample's continuation after `done` tokens, when an engine without a stream of its
    own re-sends the sample in chunks (HF generate): a fresh stream per chunk, fixed by the sample's
    seed and how far it got, so a chunked sample does not replay its first chunk's draws."""
    digest = hashlib.blake2b(f"chunk:{seed}:{done}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK
