"""What the worker keeps of each request between steps: one object per request, dropped
with one call when the request finishes or restarts from a fresh block list.

A :class:`WorkerRequest` holds the logical blocks nulled for good (what compaction takes
out of its row), the plans that scored it (what a missed plan masks), its query-ring
slot and the logical positions its captured queries cover. The plan applier
(``worker_state.py``) creates and drops them; the query ring (``query_ring.py``) keeps the
capture positions current.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["RequestTable", "WorkerRequest"]


@dataclass
class WorkerRequest:
    """One request's worker-side state."""

    # Logical block indices nulled for good.
    evicted: set[int] = field(default_factory=set)
    # Applied plan id -> ``evictable_below`` of the plans that scored the request: the
    # scheduler may free blocks below it on any of those plans' replies.
    scored: dict[int, int] = field(default_factory=dict)
    slot: int | None = None  # query-ring slot (None: not tracked)
    captured_from: int = 0  # first logical position of the captured queries
    captured_end: int | None = None  # logical position after the last one (None: none)

    def valid_rows(self, end: int) -> int:
        """Captured queries that end at logical position ``end`` (0 when the window is
        not continuous up to ``end``)."""
        if self.slot is None or self.captured_end != end:
            return 0
        return end - self.captured_from


class RequestTable:
    """The worker's requests, and the query-ring slots they hold.

    Parameters
    ----------
    slots : int
        Query-ring slots (vLLM's ``max_num_seqs``): at most this many requests tracked.
    """

    def __init__(self, slots: int) -> None:
        self._requests: dict[str, WorkerRequest] = {}
        self._free_slots = list(range(int(slots) - 1, -1, -1))

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def items(self) -> Iterator[tuple[str, WorkerRequest]]:
        return iter(self._requests.items())

    def get(self, req_id: str) -> WorkerRequest | None:
        return self._requests.get(req_id)

    def open(self, req_id: str) -> WorkerRequest:
        """The request's state (a new one on first use)."""
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = WorkerRequest()
        return req

    def track(self, req_id: str) -> int | None:
        """The request's ring slot (a free one on first use; None when all are taken)."""
        req = self.open(req_id)
        if req.slot is None and self._free_slots:
            req.slot = self._free_slots.pop()
        return req.slot

    def tracked(self) -> frozenset[str]:
        """The requests holding a ring slot."""
        return frozenset(r for r, req in self._requests.items() if req.slot is not None)

    def drop(self, req_id: str) -> None:
        """Forget the request: its blocks, scores, slot and captured window."""
        req = self._requests.pop(req_id, None)
        if req is not None and req.slot is not None:
            self._free_slots.append(req.slot)
