"""The typed scheduler <-> worker messages of one engine step.

Scheduler -> worker: a :class:`StepPlan` rides on the step's ``SchedulerOutput`` (the
attribute ``nexus_plan``), with the id of the plan made for that output (``nexus_step``):
a plan is the worker's to apply as this step's only if it is that one. Worker -> scheduler: a :class:`WorkerReply` rides on the
step's ``ModelRunnerOutput`` (``nexus_reply``). Both are frozen dataclasses of plain
Python and NumPy values, so they survive the multiprocess executor's pickling (vLLM
0.32 pickles both objects through its shared-memory message queues; the dataclasses have
no ``__slots__``, so extra attributes travel with them).

The protocol is fail-closed (see ``docs/architecture.md``):

* every plan has a ``step_id``, one more than the previous plan's;
* ``evict`` holds *every* null the worker has not acknowledged yet, so a lost plan is
  repaired by the next one (nulling twice is harmless);
* the worker acknowledges a plan by echoing its ``step_id``; the scheduler takes scores
  only from a reply that acknowledges the plan they were asked for;
* a plan is applied as the step's own only if it is the plan made for that step's output
  and newer than the last one applied: with ``k`` steps in flight an older plan the
  worker has not seen yet lacks the nulls of replies processed since it was made;
* a worker that gets no plan, or an old one, masks out every block the scheduler may
  have freed since its last applied plan (``ScoreRequest.evictable_below`` of the
  requests scored in its last ``k`` applied plans, ``k`` the steps vLLM keeps in flight)
  for that step, so it never reads a block handed to another request;
* vLLM may schedule up to ``k`` steps before the first one's reply comes back (pipeline
  parallelism, async scheduling): a reply is paired with the plan of the output it
  answers, and an event's counts are those of its plan (``ScoreRequest.tokens_after``,
  ``ScoreRequest.epoch``), never read again when the reply arrives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

__all__ = [
    "PLAN_ATTR",
    "REPLY_ATTR",
    "STEP_ATTR",
    "ScoreRequest",
    "StepPlan",
    "WorkerReply",
    "attach_plan",
    "attach_reply",
    "read_plan",
    "read_reply",
    "read_step",
]

PLAN_ATTR = "nexus_plan"
STEP_ATTR = "nexus_step"
REPLY_ATTR = "nexus_reply"
_Output = TypeVar("_Output")


@dataclass(frozen=True)
class ScoreRequest:
    """Score one request after this step's forward.

    Attributes
    ----------
    window : int
        Newest queries to score with (per layer; their mass combined over the query
        heads and scored layers as ``attention_reduce`` says, the maximum by default).
    num_logical_blocks : int
        ``ceil(tokens after this step / block_size)``: the masses' columns are the live
        blocks among the first ``num_logical_blocks`` logical blocks.
    evictable_below : int
        Logical index below which this event may evict blocks (the newest
        ``recent_blocks + 1`` live blocks are never evicted). A worker that misses the
        next plan masks the live blocks in ``[sink_blocks, evictable_below)``.
    prefill : bool
        The step was a prefill chunk (the policy uses its prefill variant).
    prompt_end : bool
        The step computed the prompt's last token: the prompt-end event, the one prompt
        event that sees the question (``EventPolicies.at(prefill=True, prompt_end=...)``).
    kinds : frozenset of str
        The evidence kinds the policy reads (:data:`nexus_vllm.core.EVIDENCE_KINDS`);
        empty for streaming and random: the worker computes nothing for them (the event
        still counts as due, for masking).
    tokens_after : int
        The request's computed tokens once the step runs, as the scheduler planned it:
        the event's budget and its full-block limit, whatever steps vLLM scheduled for
        other requests before the reply (the worker does not read it).
    epoch : int
        The request's preemption count at plan time (vLLM's ``num_preemptions``): a reply
        that arrives after the request was preempted describes a block list it no longer
        has, and is dropped.
    """

    window: int
    num_logical_blocks: int
    evictable_below: int
    prefill: bool = False
    prompt_end: bool = False
    kinds: frozenset[str] = frozenset({"mass"})
    tokens_after: int = 0
    epoch: int = 0


@dataclass(frozen=True)
class StepPlan:
    """What the worker must know for one step.

    Attributes
    ----------
    step_id : int
        1, 2, 3, ... in schedule order.
    evict : dict[str, tuple[int, ...]]
        Logical block indices nulled by the scheduler and not yet acknowledged, per
        request (sorted).
    score : dict[str, ScoreRequest]
        Requests to score after this step's forward.
    track : tuple[str, ...]
        Evicting requests scheduled this step: keep their newest queries.
    sink_blocks : int
        Oldest blocks a policy always keeps (the server's forced set).
    """

    step_id: int
    evict: dict[str, tuple[int, ...]] = field(default_factory=dict)
    score: dict[str, ScoreRequest] = field(default_factory=dict)
    track: tuple[str, ...] = ()
    sink_blocks: int = 1


@dataclass(frozen=True)
class WorkerReply:
    """What the output rank's worker reports after one step.

    Attributes
    ----------
    step_id : int or None
        The plan this step applied (its acknowledgement); None when the worker got no
        usable plan.
    evidence : dict[str, dict[str, ndarray]]
        Per evidence kind, per scored request, the reduced values over its ``N`` live
        blocks (the live blocks among its first ``num_logical_blocks``, in logical order):
        ``[W, N]`` for a ``rows`` kind (the mass of its ``window`` newest queries,
        combined over the scored layers and all query heads of all ranks by the server's
        ``attention_reduce``), ``[N]`` for a ``blocks`` kind (key norms, expected attention).
        A request the worker dropped (a fault it counted) is absent.
    scoring_seconds : float
        Device time spent scoring (wall time on CPU).
    faults : dict[str, int]
        Faults seen by the worker this step, by kind (e.g. ``plan_missing``).
    """

    step_id: int | None
    evidence: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    scoring_seconds: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)

    def of(self, kind: str) -> dict[str, np.ndarray]:
        """The reply's values of one evidence kind, by request (empty if none)."""
        return self.evidence.get(kind, {})


def attach_plan(scheduler_output: object, plan: StepPlan, *,
                step_id: int | None = None) -> None:
    """Graft ``plan`` on vLLM's ``SchedulerOutput`` (pickled whole to the workers), with
    ``step_id``, the id of the plan made for this output (default: ``plan``'s own)."""
    setattr(scheduler_output, PLAN_ATTR, plan)
    setattr(scheduler_output, STEP_ATTR, plan.step_id if step_id is None else int(step_id))


def read_step(scheduler_output: object) -> int | None:
    """The id of the plan made for a ``SchedulerOutput`` (None: not stamped)."""
    step = getattr(scheduler_output, STEP_ATTR, None)
    return step if isinstance(step, int) else None


def read_plan(scheduler_output: object) -> StepPlan | None:
    """The plan grafted on a ``SchedulerOutput`` (None: none, or not ours)."""
    plan = getattr(scheduler_output, PLAN_ATTR, None)
    return plan if isinstance(plan, StepPlan) else None


def attach_reply(model_runner_output: _Output, reply: WorkerReply) -> _Output:
    """Return a shallow copy of ``model_runner_output`` carrying ``reply``.

    A copy, because the runner returns shared constants such as
    ``EMPTY_MODEL_RUNNER_OUTPUT`` for steps without work.
    """
    import copy

    out = copy.copy(model_runner_output)
    setattr(out, REPLY_ATTR, reply)
    return out


def read_reply(model_runner_output: object) -> WorkerReply | None:
    """The reply grafted on a ``ModelRunnerOutput`` (None: none, or not ours)."""
    reply = getattr(model_runner_output, REPLY_ATTR, None)
    return reply if isinstance(reply, WorkerReply) else None
