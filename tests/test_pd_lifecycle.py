"""The shipped P/D lifecycles (`lifecycle.pd`): generated and named tests."""

from __future__ import annotations

import pytest

from lifecycle import IllegalTransition, LifecycleMachine, Registry
from lifecycle.pd import (
    CONSUMER,
    PRODUCER,
    ConsumerEvent,
    ConsumerState,
    ConsumerTracker,
    ProducerEvent,
    ProducerState,
    ProducerTracker,
)
from lifecycle.testing import table_tests

PE, PS = ProducerEvent, ProducerState
CE, CS = ConsumerEvent, ConsumerState

# Every (state, event) pair, reachability, terminal states, the stock
# `transitions` oracle and the registry, generated from each table.
TestProducerTable = table_tests(PRODUCER, ProducerTracker)
TestConsumerTable = table_tests(CONSUMER, ConsumerTracker)


def producer(*, strict=False):
    machine = LifecycleMachine(PRODUCER, strict=strict)
    return machine, Registry(machine, ProducerTracker)


def consumer():
    machine = LifecycleMachine(CONSUMER)
    return machine, Registry(machine, ConsumerTracker)


@pytest.mark.parametrize(
    ("ending", "state"),
    [
        (PE.SEND_DONE, PS.SENT),
        (PE.TIMEOUT, PS.EXPIRED),
        (PE.ABORT, PS.ABORTED),
    ],
)
def test_a_send_is_released_once_whatever_ends_it(ending, state) -> None:
    machine, registry = producer()
    tracker = registry.get_or_create("r")
    assert registry.fire("r", PE.FINISH)
    assert (tracker.state, tracker.sends, tracker.release) == (
        PS.SENDING,
        1,
        False,
    )

    assert registry.fire("r", ending)

    assert tracker.state is state
    assert tracker.release
    assert "r" not in registry
    # Every later completion is a counted no-op on an untracked id.
    for late in (PE.SEND_DONE, PE.TIMEOUT, PE.ABORT, PE.FINISH):
        assert registry.fire("r", late) is False
        assert machine.illegal_counts[(None, late)] == 1


def test_a_second_finish_while_sending_is_a_counted_noop() -> None:
    machine, registry = producer()
    tracker = registry.get_or_create("r")
    registry.fire("r", PE.FINISH)

    assert registry.fire("r", PE.FINISH) is False

    assert tracker.state is PS.SENDING
    assert tracker.sends == 1
    assert not tracker.release
    assert machine.illegal_counts[(PS.SENDING, PE.FINISH)] == 1


def test_strict_mode_raises_on_a_second_finish() -> None:
    _, registry = producer(strict=True)
    registry.get_or_create("r")
    registry.fire("r", PE.FINISH)

    with pytest.raises(IllegalTransition) as info:
        registry.fire("r", PE.FINISH)

    assert (info.value.state, info.value.event) == (PS.SENDING, PE.FINISH)


def test_an_abort_while_running_releases_nothing() -> None:
    _, registry = producer()
    tracker = registry.get_or_create("r")

    assert registry.fire("r", PE.ABORT)

    assert tracker.state is PS.ABORTED
    assert not tracker.release  # vLLM frees the blocks itself
    assert tracker.sends == 0


def test_the_consumer_drains_a_request_finished_while_receiving() -> None:
    machine, registry = consumer()
    tracker = registry.get_or_create("r")
    for event in (CE.LOOKUP, CE.LOOKUP, CE.ALLOC_REMOTE, CE.FINISH):
        assert registry.fire("r", event)
    assert tracker.state is CS.DRAINING
    assert registry.fire("r", CE.ABORT)  # still draining
    assert "r" in registry

    assert registry.fire("r", CE.RECV_DONE)

    assert tracker.state is CS.ABORTED
    assert tracker.receives == 1
    assert registry.fire("r", CE.RECV_DONE) is False
    assert machine.illegal_counts[(None, CE.RECV_DONE)] == 1


def test_a_failed_receive_runs_with_recomputed_blocks() -> None:
    machine, registry = consumer()
    tracker = registry.get_or_create("r")
    registry.fire("r", CE.ALLOC_REMOTE)

    assert registry.fire("r", CE.RECV_FAILED)
    assert registry.fire("r", CE.RECV_DONE) is False

    assert tracker.state is CS.RUNNING
    assert tracker.recompute
    assert tracker.receives == 1
    assert machine.illegal_counts[(CS.RUNNING, CE.RECV_DONE)] == 1
    assert registry.fire("r", CE.FINISH)
    assert tracker.state is CS.FINISHED
