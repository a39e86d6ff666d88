"""Recurrent states vLLM hands the scheduler half to save.

An align-mode recurrent group (Mamba, gated DeltaNet, linear attention)
keeps its state only at block-aligned checkpoints, in blocks whose place
in the request's table is not stable (interior states are nulled and
freed).  vLLM 0.33 hands the connector each checkpoint it commits, with
its exact block, in the step whose forward writes it
(``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``),
and guarantees the block only until the end of that step: a save issued
in the same step pins it, or the offer is dropped.

`StateOffers` holds one step's offers by request; the scheduler half
takes those in the range of the request's save of that step and drops
the rest (decode states past the saved prompt, the state of a prefix
just loaded, which the store holds).  No vLLM import.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

from connector.groups import NULL_BLOCK, GroupKind, StateOffer
from connector.metadata import JobKind

if TYPE_CHECKING:
    from connector.groups import KVGroups


class StateOffers:
    """One step's recurrent-state offers, by request.

    Args:
        groups: The model's KV cache groups.
        saves: Whether the connector saves (else every offer is ignored).
    """

    def __init__(self, groups: KVGroups, *, saves: bool = True) -> None:
        self._groups = frozenset(
            g.index
            for g in groups.groups
            if g.kind is GroupKind.STATE and saves
        )
        self._block_size = groups.groups[0].block_size
        self._offers: dict[str, list[StateOffer]] = {}
        #: Offers seen ("offered"), saved, or dropped.
        self.counts: collections.Counter[str] = collections.Counter()

    def take(self, scheduler_output: Any) -> None:
        """Read this step's hand-offs (none without a recurrent group)."""
        if not self._groups:
            return
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        offloads = getattr(state, "boundary_state_offloads", None) or {}
        for req_id, entries in offloads.items():
            offers = [
                StateOffer(group, block, boundary)
                for group, block, boundary in entries
                if group in self._groups and block != NULL_BLOCK
            ]
            self.counts["offered"] += len(entries)
            self.counts["dropped"] += len(entries) - len(offers)
            if offers:
                self._offers[req_id] = offers

    def for_job(
        self, kind: JobKind, tracker: Any, first: int, last: int
    ) -> list[StateOffer] | None:
        """`tracker`'s offers its save of blocks ``[first, last)`` stores.

        A state is stored with the blocks of the prefix it follows: its
        boundary is in ``(first, last]`` blocks.  The request's other
        offers are dropped.  None for a load (which reads its state from
        the request's table).
        """
        if kind is not JobKind.SAVE:
            return None
        if not self._offers:
            return []  # none this step (always, without recurrent groups)
        offered = self._offers.pop(tracker.req_id, ())
        bs = self._block_size
        kept = [
            o
            for o in offered
            if o.boundary % bs == 0 and first * bs < o.boundary <= last * bs
        ]
        self.counts["saved"] += len(kept)
        self.counts["dropped"] += len(offered) - len(kept)
        return kept

    def end_step(self) -> None:
        """Drop the offers no save of the step took."""
        if self._offers:
            self.counts["dropped"] += sum(map(len, self._offers.values()))
            self._offers.clear()
