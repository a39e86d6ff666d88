"""Prompt token ids for tests, the demo, benchmarks and the e2e tier.

Two kinds, one home:

- `arithmetic_prompt(seed, length)`: a fixed sequence per seed; prompts of
  different seeds share no prefix, and a shorter prompt of a seed is a
  prefix of a longer one.
- `random_tokens(rng, n)`: `n` ids drawn from `rng` (seeded by the
  caller); the draws are exactly `rng.randrange(low, vocab)` per token, so
  a caller's other draws from the same `rng` are unchanged by using it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import random

VOCAB: Final = 500
"""Token ids drawn below this by default (the harness's vocabulary is 512)."""


def arithmetic_prompt(seed: int, length: int) -> list[int]:
    """A deterministic prompt of `length` tokens; seeds share no prefix."""
    return [(seed * 37 + i * 11) % VOCAB for i in range(length)]


def random_tokens(
    rng: random.Random, n: int, *, low: int = 0, vocab: int = VOCAB
) -> list[int]:
    """`n` token ids in `[low, vocab)`, drawn from `rng` one by one."""
    return [rng.randrange(low, vocab) for _ in range(n)]
