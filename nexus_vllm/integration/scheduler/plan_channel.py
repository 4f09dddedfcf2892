"""The scheduler's end of the plan channel: step ids, and nulls resent until acknowledged.

Every plan gets the next ``step_id`` and carries *every* null the worker has not
acknowledged yet (so a lost plan is repaired by the next one); a reply acknowledges the
plan whose ``step_id`` it echoes, and retires the nulls sent in that plan or earlier. A
reply that acknowledges anything else is a fault: its scores are dropped and its nulls
stay pending (``protocol`` module docstring). The pending nulls of each request are its
state's ``unacked``: they go when the request finishes or restarts (its block list goes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from nexus_vllm.integration.protocol import StepPlan, WorkerReply
from nexus_vllm.integration.scheduler.request_state import RequestEvictionState, RequestStates

__all__ = ["PlanChannel"]


class PlanChannel:
    """Step ids and the nulls the worker has not acknowledged.

    Parameters
    ----------
    states : RequestStates
        Each request's pending nulls are its ``unacked``.
    fault : callable
        ``(kind, message, exc=...)``: count and log a fault.

    Attributes
    ----------
    step_id : int
        The id of the last plan opened (0 before the first).
    """

    def __init__(self, states: RequestStates, fault: Callable[..., None]) -> None:
        self.states = states
        self._fault = fault
        self.step_id = 0

    @property
    def unacked(self) -> dict[str, dict[int, int]]:
        """Per request with pending nulls, logical block index -> id of the first plan
        that carried its null (0: not sent yet); a copy."""
        return {r: dict(st.unacked) for r, st in self.states.items() if st.unacked}

    @staticmethod
    def record(st: RequestEvictionState, indices: Iterable[int]) -> None:
        """These entries of the request's block list were just nulled (sent with the
        next plan)."""
        for j in indices:
            st.unacked[j] = 0

    def open_step(self) -> tuple[int, dict[str, tuple[int, ...]]]:
        """Open the next plan: its ``step_id`` and the nulls it carries (``StepPlan.evict``:
        every pending one, sorted per request)."""
        self.step_id += 1
        evict: dict[str, tuple[int, ...]] = {}
        for req_id, st in self.states.items():
            pending = st.unacked
            if pending:
                evict[req_id] = tuple(sorted(pending))
                for j, sent in pending.items():
                    if not sent:
                        pending[j] = self.step_id
        return self.step_id, evict

    def acknowledge(self, plan: StepPlan, reply: WorkerReply | None) -> bool:
        """Whether ``reply`` acknowledges ``plan`` (then the nulls sent up to it are
        retired); a reply that does not is counted as a fault."""
        if reply is None or reply.step_id != plan.step_id:
            got = None if reply is None else reply.step_id
            self._fault("plan_unacknowledged", f"the worker did not apply plan "
                        f"{plan.step_id} (acknowledged {got}); its nulls are resent and "
                        "its scores dropped")
            return False
        for _, st in self.states.items():
            pending = st.unacked
            for j in [j for j, sent in pending.items() if 0 < sent <= plan.step_id]:
                del pending[j]
        return True
