"""Test doubles of the scheduler's parts for injected faults (``NEXUS_VLLM_FAULTS``).

The reliability tests switch faults on by environment variable (``integration/faults.py``
parses it). The production parts carry no fault checks: when the variable names a
scheduler fault, :func:`~nexus_vllm.integration.faults.with_doubles` gives
:class:`~nexus_vllm.integration.scheduler.scheduler.NexusScheduler` a double of the part
instead (imported from here then only), which fails the way the real part may and is
absorbed by the same code:

* ``policy_error``: :class:`FailingEvictor`, whose eviction event raises before it frees
  anything (the evictor skips the event, ``policy_error`` counted);
* ``plan_duplicate``: :class:`DuplicatingSender`, which puts the previous plan on the
  step's output instead of the new one (the worker applies only the plan made for the
  step and does not acknowledge; the scheduler resends the nulls with a later plan).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from nexus_vllm.integration.compat.vllm_types import EngineRequest
from nexus_vllm.integration.protocol import ScoreRequest, StepPlan, attach_plan
from nexus_vllm.integration.scheduler.evictor import Evictor
from nexus_vllm.integration.scheduler.manager import PlanSender
from nexus_vllm.integration.scheduler.request_state import RequestEvictionState

__all__ = ["DuplicatingSender", "FailingEvictor"]


class FailingEvictor(Evictor):
    """An evictor whose events raise when ``fires()`` says so.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`Evictor`.
    fires : callable
        ``() -> bool``: whether this event's policy fails.
    """

    def __init__(self, *args: Any, fires: Callable[[], bool], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fires = fires

    def evict(self, st: RequestEvictionState, request: EngineRequest, sreq: ScoreRequest,
              gathered: Mapping[str, torch.Tensor]) -> None:
        if self._fires():
            raise RuntimeError("injected policy failure")
        super().evict(st, request, sreq, gathered)


class DuplicatingSender(PlanSender):
    """A sender that, when ``fires()`` says so, sends the previous plan again (stamped
    with the new step's id) instead of the step's own.

    Parameters
    ----------
    fires : callable
        ``() -> bool``: whether this step gets the previous plan.
    """

    def __init__(self, *, fires: Callable[[], bool]) -> None:
        self._fires = fires
        self._last: StepPlan | None = None

    def send(self, scheduler_output: object, plan: StepPlan) -> None:
        previous, self._last = self._last, plan
        if previous is not None and self._fires():
            attach_plan(scheduler_output, previous, step_id=plan.step_id)
        else:
            super().send(scheduler_output, plan)

