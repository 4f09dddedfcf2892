"""The scheduler's end of the plan channel: step ids, and nulls resent until acknowledged.

Every plan gets the next ``step_id`` and carries *every* null the worker has not
acknowledged yet (so a lost plan is repaired by the next one); a reply acknowledges the
plan whose ``step_id`` it echoes, and retires the nulls sent in that plan or earlier. A
reply that acknowledges anything else is a fault: its scores are dropped and its nulls
stay pending (``protocol`` module docstring). The pending nulls of each request are its
state's ``unacked``: they go when the request finishes or restarts (its block list goes).

With ``k`` steps in flight, plans ``N+1 .. N+k-1`` are opened before plan ``N``'s reply:
they carry the nulls still pending then, and plan ``N``'s acknowledgement retires only
the nulls sent up to plan ``N``; so the logic is the same for every ``k``. Replies come
back in plan order (vLLM processes outputs in schedule order): one acknowledging a plan
older than one already acknowledged is counted as the fault ``plan_reordered``.
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
    answered : int
        Plans whose reply was processed, acknowledged or not.
    acknowledged : int
        The id of the newest plan acknowledged (0: none yet).
    """

    def __init__(self, states: RequestStates, fault: Callable[..., None]) -> None:
        self.states = states
        self._fault = fault
        self.step_id = 0
        self.answered = 0
        self.acknowledged = 0

    def outstanding(self) -> int:
        """Plans opened whose reply has not been processed yet (vLLM's steps in flight
        past the one being answered)."""
        return self.step_id - self.answered

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
        self.answered += 1
        if reply is None or reply.step_id != plan.step_id:
            got = None if reply is None else reply.step_id
            self._fault("plan_unacknowledged", f"the worker did not apply plan "
                        f"{plan.step_id} (acknowledged {got}); its nulls are resent and "
                        "its scores dropped")
            return False
        if plan.step_id < self.acknowledged:
            self._fault("plan_reordered", f"plan {plan.step_id} was acknowledged after plan "
                        f"{self.acknowledged}; only the nulls it carried are retired")
        self.acknowledged = max(self.acknowledged, plan.step_id)
        for _, st in self.states.items():
            pending = st.unacked
            for j in [j for j, sent in pending.items() if 0 < sent <= plan.step_id]:
                del pending[j]
        return True
