"""Issue 34 (lifecycle 1.0): generated tests, refusals, outcomes, threads.

A small tiered cache of our own drives every point: a block is placed
hot when there is room, else cold (the unguarded last alternative), and
only cold blocks spill to disk.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import pytest

from lifecycle import LifecycleMachine, Row, Table, Tracker, define_tracker
from lifecycle.testing import check_row, table_tests


class Tier(enum.Enum):
    NEW = "new"
    HOT = "hot"
    COLD = "cold"
    DISK = "disk"
    GONE = "gone"


class TierEvent(enum.Enum):
    PLACE = "place"
    SPILL = "spill"
    DROP = "drop"


@define_tracker
class Block(Tracker[Tier, int]):
    state: Tier = Tier.NEW
    room: int = 1


def has_room(block: Block, _data: object) -> bool:
    return block.room > 0


T, V = Tier, TierEvent
PLACE_HOT = Row(T.NEW, V.PLACE, T.HOT, guard=has_room)
PLACE_COLD = Row(T.NEW, V.PLACE, T.COLD)  # the unguarded last alternative
TIERS: Table[Tier, TierEvent] = Table(
    [
        PLACE_HOT,
        PLACE_COLD,
        Row(T.COLD, V.SPILL, T.DISK),
        Row(T.HOT, V.DROP, T.GONE),
        Row(T.COLD, V.DROP, T.GONE),
        Row(T.DISK, V.DROP, T.GONE),
    ],
    initial=T.NEW,
    terminal={T.GONE},
    name="tiers",
)


def no_room(block: Block, _row: object) -> None:
    """A set-up: the hot tier is full, so the block goes cold."""
    block.room = 0


TestTiers = table_tests(
    TIERS, Block, setups={PLACE_COLD: no_room}, examples=30, key=1
)


class TestUnguardedLastAlternative:
    """Point 1: reachability through an unguarded last alternative."""

    def test_a_state_behind_it_is_reachable(self) -> None:
        # DISK is only reachable through NEW --place--> COLD.
        TestTiers().test_every_state_is_reachable()

    def test_its_failure_says_what_it_is_and_what_to_supply(self) -> None:
        with pytest.raises(AssertionError) as info:
            check_row(PLACE_COLD, TIERS, Block, key=1)
        text = str(info.value)
        assert "guarded row" not in text
        assert "unguarded last alternative `NEW --place--> COLD`" in text
        assert "every earlier alternative's guard refuse" in text
        assert "setups={<this row>:" in text

    def test_a_state_set_up_is_not_used_for_it(self) -> None:
        calls: list[Any] = []

        def room(block: Block, row: Any) -> None:
            calls.append(row)
            block.room = 1

        check_row(PLACE_HOT, TIERS, Block, {T.NEW: room}, key=1)
        with pytest.raises(AssertionError):
            check_row(PLACE_COLD, TIERS, Block, {T.NEW: room}, key=1)
        assert calls == [PLACE_HOT]

    def test_the_machine_applies_it_when_the_guard_refuses(self) -> None:
        machine: LifecycleMachine[Tier, TierEvent, Block] = LifecycleMachine(
            TIERS
        )
        block = Block(1, room=0)
        assert machine.fire(block, V.PLACE)
        assert block.state is T.COLD


class TestGeneratedTestsIgnoreLogging:
    """Point 7: check_case checks counters, not log records."""

    def test_logging_disabled_everywhere(self) -> None:
        from lifecycle.testing import check_case, matrix  # noqa: PLC0415

        illegal = [c for c in matrix(TIERS) if not c.legal]
        assert illegal
        logging.disable(logging.CRITICAL)
        try:
            for case in illegal:
                check_case(case, TIERS, Block, {PLACE_COLD: no_room}, key=1)
        finally:
            logging.disable(logging.NOTSET)

    def test_an_uncounted_illegal_event_still_fails(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from lifecycle.testing import Case, check_case  # noqa: PLC0415

        def quiet(_self: object, _tracker: object, _event: object) -> bool:
            return False

        monkeypatch.setattr(LifecycleMachine, "_illegal", quiet)
        with pytest.raises(AssertionError, match="illegal count not 1"):
            check_case(Case(T.GONE, V.DROP, None), TIERS, Block, key=1)
