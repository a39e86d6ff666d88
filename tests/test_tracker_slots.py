"""Trackers stay slotted, and the fast-tracker check says so, on 3.11-3.13.

Since Python 3.12 ``typing.Generic`` is implemented in C: it declares no
``__slots__`` yet adds no ``__dict__``.  The check judges the instance
layout (``__dictoffset__``), not the presence of a ``__slots__`` entry, so
`Tracker` subclasses are accepted there and still refused wherever a base
really gives trackers a ``__dict__``.
"""

from __future__ import annotations

import typing

import attrs
import pytest

from connector.scheduler.admission import LookupTracker
from connector.scheduler.requests import RequestTracker
from lifecycle import LifecycleMachine, Registry, Tracker, define_tracker
from lifecycle.kv import KVTracker, State
from lifecycle.pd import ConsumerTracker, ProducerTracker
from lifecycle.tracker import slow_reasons
from tests.user_lifecycle import TABLE, JobState, JobTracker


class _Mixin:
    """A plain mixin: no ``__slots__``, so a ``__dict__`` per instance."""


@pytest.fixture
def generic_as_on_312(monkeypatch):
    """``typing.Generic`` shaped as on 3.12+: no ``__slots__`` entry.

    On 3.11 the entry is removed for the test (the class already exists,
    so its instance layout, without a ``__dict__``, does not change); on
    3.12 and later there is none to remove.
    """
    monkeypatch.delattr(typing.Generic, "__slots__", raising=False)
    assert "__slots__" not in vars(typing.Generic)
    assert typing.Generic.__dictoffset__ == 0


@pytest.mark.parametrize(
    "cls",
    [
        KVTracker,
        LookupTracker,
        RequestTracker,
        ProducerTracker,
        ConsumerTracker,
        JobTracker,
    ],
)
def test_every_shipped_tracker_is_slotted(cls) -> None:
    assert typing.Generic in cls.__mro__
    assert slow_reasons(cls) == []
    assert cls.__dictoffset__ == 0
    tracker = object.__new__(cls)
    assert not hasattr(tracker, "__dict__")


def test_a_tracker_under_a_generic_without_slots_entry_is_accepted(
    generic_as_on_312,
) -> None:
    """The 3.12+ shape of the MRO: ``import lifecycle.kv`` raised here."""

    @define_tracker
    class Fresh(Tracker[JobState]):
        state: JobState = JobState.WAITING
        note: str = ""

    assert slow_reasons(Fresh) == []
    registry = Registry(LifecycleMachine(TABLE), Fresh)
    tracker = registry.get_or_create("r")
    assert not hasattr(tracker, "__dict__")
    with pytest.raises(AttributeError):
        tracker.other = 1  # type: ignore[attr-defined]


def test_a_base_without_slots_is_still_refused(generic_as_on_312) -> None:
    with pytest.raises(TypeError, match="_Mixin has no __slots__") as info:

        @define_tracker
        class Leaky(Tracker[JobState], _Mixin):
            state: JobState = JobState.WAITING

    assert "Generic" not in str(info.value)
    assert "define_tracker" in str(info.value)


def test_a_dict_slot_is_refused() -> None:
    class WithDict:
        __slots__ = ("__dict__",)

    with pytest.raises(TypeError, match="WithDict has no __slots__"):

        @define_tracker
        class Leaky(Tracker[JobState], WithDict):
            state: JobState = JobState.WAITING


def test_an_unslotted_attrs_subclass_is_refused_by_name() -> None:
    @attrs.define(slots=False, eq=False, on_setattr=attrs.setters.NO_OP)
    class Loose(Tracker[State]):
        state: State = State.NEW

    reasons = slow_reasons(Loose)
    assert reasons == ["Loose has no __slots__ (a __dict__ per tracker)"]
