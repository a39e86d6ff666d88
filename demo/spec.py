"""The seeded workload of a demo session: what runs, drawn from one seed.

`WorkloadConfig` says what a session runs; `request_specs` draws one
instance's requests (`RequestSpec`) lazily from the seed: shared prompt
prefixes, unique prompts, aborts (some in flight) and duplicate
`request_finished` calls (vLLM #43281).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Final

import attrs

from harness.prompts import random_tokens

_FORCED_ABORT_INDEX: Final = 1  # each instance's second request


@attrs.frozen
class WorkloadConfig:
    """What a session runs; every random draw comes from `seed`.

    Attributes:
        requests: Requests over both instances.
        seed: Seeds every draw.
        share_b: Share of the requests served by instance B.
        warmup: Requests A finishes before B gets its first one.
        prefixes: Shared prompt prefixes.
        prefix_blocks: (min, max) blocks of a shared prefix.
        unique_share: Share of requests with no shared prefix.
        suffix_tokens: (min, max) prompt tokens after the prefix.
        max_tokens: (min, max) generated tokens.
        num_blocks: KV blocks per instance (few, for preemptions).
        block_size: Tokens per block.
        kv_width: Floats per token per layer.
        max_num_seqs: Running requests per instance.
        concurrency: Requests an instance holds unfinished at most.
        abort_rate: Share of requests aborted 1-30 ticks after arrival,
            half of them in flight; each instance's second request is
            always aborted two ticks after arrival.
        replay_finish_rate: Share of finished requests that get a second
            `request_finished` (vLLM #43281); each instance's first
            finished request always does.
        load_failures: Loads that fail and are recomputed (B only).
        restart_master_after: Restart the master once, after this many
            finished requests (None: never).
        stall_s: Give up when nothing finished for this long.
    """

    requests: int = 2000
    seed: int = 0
    share_b: float = 0.5
    warmup: int = 8
    prefixes: int = 12
    prefix_blocks: tuple[int, int] = (2, 4)
    unique_share: float = 0.2
    suffix_tokens: tuple[int, int] = (1, 24)
    max_tokens: tuple[int, int] = (2, 24)
    num_blocks: int = 24
    block_size: int = 16
    kv_width: int = 32
    max_num_seqs: int = 8
    concurrency: int = 12
    abort_rate: float = 0.03
    replay_finish_rate: float = 0.01
    load_failures: int = 1
    restart_master_after: int | None = None
    stall_s: float = 60.0


@attrs.frozen
class RequestSpec:
    """One request of the workload."""

    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    prefix: int  # shared prefix index, -1 for none
    abort_after: int  # ticks after arrival, 0 for never
    abort_in_flight: bool
    replay_finish: bool


def _prefixes(config: WorkloadConfig) -> list[tuple[int, ...]]:
    rng = random.Random(f"{config.seed}/prefixes")
    lo, hi = config.prefix_blocks
    return [
        tuple(random_tokens(rng, rng.randint(lo, hi) * config.block_size))
        for _ in range(config.prefixes)
    ]


def request_specs(
    config: WorkloadConfig, name: str, count: int
) -> Iterator[RequestSpec]:
    """The requests of one instance, drawn lazily from the seed."""
    rng = random.Random(f"{config.seed}/{name}")
    prefixes = _prefixes(config)
    for index in range(count):
        if prefixes and rng.random() >= config.unique_share:
            prefix_index = rng.randrange(len(prefixes))
            prefix = prefixes[prefix_index]
        else:
            prefix_index, prefix = -1, ()
        suffix = random_tokens(rng, rng.randint(*config.suffix_tokens))
        forced = index == _FORCED_ABORT_INDEX
        aborted = forced or rng.random() < config.abort_rate
        yield RequestSpec(
            req_id=f"{name}-{index:06d}",
            prompt=(*prefix, *suffix),
            max_tokens=rng.randint(*config.max_tokens),
            prefix=prefix_index,
            abort_after=(2 if forced else rng.randint(1, 30))
            if aborted
            else 0,
            abort_in_flight=not forced and rng.random() < 0.5,  # noqa: PLR2004
            replay_finish=index == 0
            or rng.random() < config.replay_finish_rate,
        )
