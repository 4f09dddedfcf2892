"""Test doubles of the worker's parts for injected faults (``NEXUS_VLLM_FAULTS``).

The reliability tests switch faults on by environment variable (``integration/faults.py``
parses it). The production parts carry no fault checks: when the variable names a worker
fault, :func:`~nexus_vllm.integration.faults.with_doubles` gives
:class:`~nexus_vllm.integration.worker.worker.NexusWorker` a double of the part instead
(imported from here then only), which fails the way the real part may and is absorbed by
the same code:

* ``score_error``: :class:`FailingScorer`, whose gathering raises inside the scorer's own
  ``try`` (the step's events are dropped on every rank, ``score_error`` counted);
* ``plan_lost``: :class:`LosingPlanCheck`, which drops the step's plan (the worker masks
  what may have been freed and does not acknowledge, ``plan_lost`` counted).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nexus_vllm.integration.protocol import StepPlan
from nexus_vllm.integration.worker.block_scorer import BlockScorer
from nexus_vllm.integration.worker.wire import Segment
from nexus_vllm.integration.worker.worker_state import PlanCheck
from nexus_vllm.integration.worker.worker_step import Batch

__all__ = ["FailingScorer", "LosingPlanCheck"]


class FailingScorer(BlockScorer):
    """A scorer whose gathering raises when ``fires(rank=...)`` says so.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`BlockScorer`.
    fires : callable
        ``(rank) -> bool``: whether this scoring step fails on this rank.
    """

    def __init__(self, *args: Any, fires: Callable[..., bool], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fires = fires

    def _gather(self, batch: Batch, segments: list[Segment], flat: torch.Tensor) -> None:
        if self._fires(rank=self.layout.rank):
            raise RuntimeError("injected scoring failure")
        super()._gather(batch, segments, flat)


class LosingPlanCheck(PlanCheck):
    """A plan check that drops the step's plan when ``fires()`` says so.

    Parameters
    ----------
    fault : callable
        ``(kind, message)``: count and log a fault.
    fires : callable
        ``() -> bool``: whether this step's plan is lost.
    """

    def __init__(self, fault: Callable[..., None], *, fires: Callable[[], bool]) -> None:
        super().__init__(fault)
        self._fires = fires

    def usable(self, plan: StepPlan | None, own: int | None,
               last_applied: int) -> StepPlan | None:
        if self._fires():
            self._fault("plan_lost", "injected: the step's plan is dropped")
            return None
        return super().usable(plan, own, last_applied)

