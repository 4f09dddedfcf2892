"""The worker's eviction state: the plan applied, the step's parts wired, the reply built.

One object per worker process, owned by :class:`~nexus_vllm.integration.worker.worker.NexusWorker`.
It is the same code on every backend, device and model runner (the runner is reached only
through its adapter, ``integration/compat/runners.py``): on CPU (tested end to end in CI) and on
CUDA. It keeps one :class:`~nexus_vllm.integration.worker.request_table.WorkerRequest` per
request (``request_table.py``) and owns the step's parts, each fed to the hook that uses
it (``integration/worker/worker_step.py`` says what they hand each other):

* :class:`PlanCheck`, which decides whether the step's plan may be applied;
* :class:`~nexus_vllm.integration.worker.compaction.Compactor`, fed to the metadata builders;
* :class:`~nexus_vllm.integration.worker.query_ring.QueryRing`, fed to the attention impls;
* :class:`~nexus_vllm.integration.worker.block_scorer.BlockScorer`, run after the forward.

One step (``NexusWorker.execute_model``):

1. :meth:`WorkerEvictionState.begin_step` checks the
   :class:`~nexus_vllm.integration.protocol.StepPlan` (fail-closed, :class:`PlanCheck`),
   writes the null block id over newly evicted entries through the runner adapter, keeps
   each request's evicted logical blocks, and begins a frozen
   :class:`~nexus_vllm.integration.worker.worker_step.Step`, handing the compactor the
   blocks each row loses and the ring the requests to track;
2. vLLM builds attention metadata: the compactor rewrites it for rows with evicted
   blocks, with no device-to-host read, and keeps the batch it built;
3. during the forward, the ring copies the newest queries of tracked requests;
4. :meth:`finish_forward` hands the scorer the plan, compaction's batch and whether
   capture failed; it scores every request due (all scored layers at once), reduces over
   tensor-parallel ranks, gathers the pipeline stages' parts on the last stage and
   returns the scores on their way to the host (one non-blocking copy);
5. :meth:`reply_token` (after sampling) takes what the step's reply needs (its
   acknowledgement, the pending scores, the faults so far) and :meth:`end_step` restores
   any temporarily masked entries and disarms the parts; :meth:`ReplyToken.reply` then
   waits for the copy and builds the :class:`~nexus_vllm.integration.protocol.WorkerReply`,
   at once, or under async scheduling when vLLM takes the step's output, after the next
   step has begun. Nothing of a step is shared with the next.

With ``k`` steps in flight (pipeline stages, async scheduling) the scheduler may free a
block on the reply of any of the last ``k`` plans this worker applied before it hears of
the null: a worker that misses a plan masks the evictable blocks of the requests those
``k`` plans scored.

``NEXUS_VLLM_SELF_CHECK=1`` (the GPU check and some end-to-end tests set it) adds two
checks on the live server, each a host read: every scored layer's key view is compared
once with the keys the layer just wrote (through vLLM's own cache writer and slot
mapping), and the first scoring steps are recomputed with the torch reference and
compared with the kernel. A mismatch raises: it means scores would be garbage.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from nexus_vllm.integration import faults
from nexus_vllm.integration.compat.runners import RunnerAdapter
from nexus_vllm.integration.compat.vllm_compat import NULL_BLOCK_ID, reset_request_ids
from nexus_vllm.integration.config import SELF_CHECK_ENV, self_check_enabled
from nexus_vllm.integration.protocol import StepPlan, WorkerReply, read_step
from nexus_vllm.integration.worker.block_scorer import BlockScorer, PendingScores
from nexus_vllm.integration.worker.compaction import Compactor
from nexus_vllm.integration.worker.query_ring import QueryRing
from nexus_vllm.integration.worker.request_table import RequestTable
from nexus_vllm.integration.worker.wire import RankLayout, StageLinks
from nexus_vllm.integration.worker.worker_step import LayerKeys, Masked, SelfCheckError, Step

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from nexus_vllm.core import Rotary

logger = init_logger(__name__)

__all__ = ["SELF_CHECK_ENV", "LayerKeys", "PlanCheck", "ReplyToken", "SelfCheckError",
           "WorkerEvictionState", "WorkerParts", "layer_index"]

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """Decoder layer number in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    m = _LAYER_INDEX.search(f".{layer_name}.")
    return int(m.group(1)) if m else 0


@dataclass(frozen=True)
class ReplyToken:
    """What one step's reply needs, taken when the step ends (after sampling): its
    :meth:`reply` may then run later, in another thread (vLLM's output thread under async
    scheduling), while the next step runs."""

    ack: int | None
    pending: PendingScores | None
    faults: Mapping[str, int]
    scorer: BlockScorer

    def reply(self) -> WorkerReply:
        """The step's reply (waits for the scores' host copy)."""
        evidence = self.scorer.collect(self.pending)
        faults = dict(self.faults)
        for kind, n in evidence.faults.items():
            faults[kind] = faults.get(kind, 0) + n
        return WorkerReply(step_id=self.ack, evidence=evidence.evidence,
                           scoring_seconds=evidence.seconds, faults=faults)


class PlanCheck:
    """Whether a step may apply the plan it came with (fail-closed, as ``protocol`` says).

    A plan is usable only if it is the step's own (the one stamped on its output; an
    unstamped output's plan is taken as its own) and newer than the last one applied.
    Any other case is counted as a fault, and the step masks what may have been freed.

    Parameters
    ----------
    fault : callable
        ``(kind, message)``: count and log a fault.
    """

    def __init__(self, fault: Callable[..., None]) -> None:
        self._fault = fault

    def usable(self, plan: StepPlan | None, own: int | None,
               last_applied: int) -> StepPlan | None:
        """``plan`` if the step may apply it, else None.

        Parameters
        ----------
        plan : StepPlan or None
            The plan on the step's output.
        own : int or None
            The id of the plan made for that output (None: not stamped).
        last_applied : int
            The id of the last plan this worker applied (0: none yet).
        """
        ok = (plan is not None and plan.step_id > last_applied
              and (own is None or plan.step_id == own))
        if plan is None:
            self._fault("plan_missing", "a step arrived without an eviction plan; masking "
                        "every block the scheduler may have freed for this step")
        elif not ok:
            self._fault("plan_stale", f"plan {plan.step_id} arrived for step {own} after plan "
                        f"{last_applied}; masking possibly freed blocks for this step")
        elif plan.step_id != last_applied + 1:
            self._fault("plan_gap", f"plans {last_applied + 1}..{plan.step_id - 1} never "
                        "arrived; their evictions are resent in this one")
        return plan if ok else None


@dataclass(frozen=True)
class WorkerParts:
    """How :class:`WorkerEvictionState` builds the parts a test double may stand in for
    (``faults.with_doubles``, ``integration/testing/worker_doubles.py``): a class or
    factory taking the real one's arguments."""

    scorer: Callable[..., BlockScorer] = BlockScorer
    plan_check: Callable[[faults.FaultLog], PlanCheck] = PlanCheck


class WorkerEvictionState:
    """Per-worker eviction state (see module docstring).

    Parameters
    ----------
    block_size : int
        KV block size (tokens).
    window : int
        W: queries kept per request and scored layer (the longest scoring window).
    max_requests : int
        Requests the query ring can track at once (vLLM's ``max_num_seqs``).
    device : torch.device
    score_backend : str
        ``nexus_vllm.kernels`` backend for scoring and compaction (``"torch"`` on CPU,
        where vLLM disables Triton; ``"auto"`` elsewhere).
    layout : RankLayout, optional
        TP rank and pipeline stage (default: a single rank); TP rank 0 of the last stage
        is vLLM's output rank.
    scored_layers : int
        Scored layers of the whole model, over every stage (0: those this worker holds).
    attention_reduce : {"mean", "max"}
        How the scored heads and layers combine (``EvictionConfig.attention_reduce``).
    steps_in_flight : int
        k, the steps vLLM schedules before the first reply (``max_concurrent_batches``):
        how many applied plans a missed plan's masking covers.
    stages : StageLinks, optional
        Links to the last pipeline stage (needed with pipeline parallelism).
    rotary : Rotary, optional
        The scored layers' rotary table (evidence kinds that un-rotate queries read it).
    parts : WorkerParts, optional
        The scorer and plan check to build (default: the real ones).
    """

    def __init__(self, *, block_size: int, window: int, max_requests: int,
                 device: torch.device, score_backend: str,
                 layout: RankLayout | None = None, scored_layers: int = 0,
                 attention_reduce: str = "mean", steps_in_flight: int = 1,
                 stages: StageLinks | None = None, rotary: Rotary | None = None,
                 parts: WorkerParts | None = None) -> None:
        parts = parts or WorkerParts()
        self.max_requests = int(max_requests)
        self.runner: RunnerAdapter | None = None
        self.fault = faults.FaultLog(logger)
        self.self_check = self_check_enabled()
        self.requests = RequestTable(self.max_requests)
        self.plans = parts.plan_check(self.fault)
        self.compactor = Compactor(block_size=block_size, max_requests=max_requests,
                                   backend=score_backend)
        self.ring = QueryRing(window=window, max_requests=max_requests, device=device,
                              fault=self.fault, requests=self.requests,
                              compaction=self.compactor.result)
        self.scorer = parts.scorer(self.ring, block_size=block_size,
                                   max_requests=max_requests, device=device,
                                   backend=score_backend, layout=layout or RankLayout(),
                                   scored_layers=scored_layers, attention_reduce=attention_reduce,
                                   fault=self.fault, self_check=self.self_check,
                                   stages=stages, rotary=rotary)
        self.last_step = 0
        # Ids of the last k plans applied: the scheduler may free blocks of the requests
        # they scored on any of their replies before this worker hears of the nulls.
        self.applied: deque[int] = deque(maxlen=max(1, int(steps_in_flight)))
        self.sink_blocks = 1
        self.current: Step | None = None  # begun and not yet ended

    @property
    def window(self) -> int:
        return self.ring.window

    # -- binding -----------------------------------------------------------------------
    def allocate_ring(self, num_layers: int, num_heads: int, head_size: int,
                      dtype: torch.dtype) -> None:
        """Allocate the query ring for ``num_layers`` scored layers (before vLLM
        profiles memory for the KV cache, so the ring is accounted for)."""
        self.ring.allocate(num_layers, num_heads, head_size, dtype)

    def bind_layers(self, runner: RunnerAdapter, scored: dict[int, LayerKeys]) -> None:
        """Attach the runner adapter and the scored layers (model layer number -> keys)."""
        self.runner = runner
        self.compactor.bind(runner.batch_req_ids)
        self.ring.bind(scored)

    def ring_bytes(self) -> int:
        return self.ring.nbytes()

    # -- the plan ----------------------------------------------------------------------
    def begin_step(self, scheduler_output: SchedulerOutput, plan: StepPlan | None) -> Step:
        """Apply ``plan`` to the runner's block tables and begin one step."""
        runner = self.runner
        assert runner is not None, "bind_layers() first"
        if self.current is not None:  # a previous step raised before end_step()
            self.end_step(self.current)
        runner.observe(scheduler_output)
        gone = set(scheduler_output.finished_req_ids) | reset_request_ids(scheduler_output)
        usable = self.plans.usable(plan, read_step(scheduler_output), self.last_step)
        masked: tuple[Masked, ...] = ()
        if usable is not None:
            self._apply(usable, gone)
        else:
            masked = self._mask_suspects(gone)
        for req_id in gone:
            self.requests.drop(req_id)
        if usable is not None:
            self._record_scores(usable)
            tracked = frozenset(usable.track)
        else:
            # Keep the windows of known requests continuous through a faulty step.
            tracked = self.requests.tracked()
        for req_id in tracked:
            self.requests.track(req_id)
        compacted = {r: len(req.evicted) for r, req in self.requests.items() if req.evicted}
        for m in masked:
            compacted[m.req_id] = compacted.get(m.req_id, 0) + len(m.idxs)
        step = Step(plan=usable, tracked=tracked, compacted=compacted, masked=masked)
        self.compactor.begin(step.compacted)
        self.ring.begin(step.tracked)
        self.current = step
        return step

    def _apply(self, plan: StepPlan, gone: set[str]) -> None:
        """Null the plan's new evictions for good."""
        runner = self.runner
        assert runner is not None
        self.sink_blocks = plan.sink_blocks
        for req_id, idxs in plan.evict.items():
            if req_id in gone:
                continue
            done = self.requests.open(req_id).evicted
            new = [j for j in idxs if j not in done]
            runner.set_entries(req_id, new, [NULL_BLOCK_ID] * len(new))
            done.update(new)
        self.last_step = plan.step_id

    def _record_scores(self, plan: StepPlan) -> None:
        """Remember which requests ``plan`` scored, as long as it is among the last k."""
        self.applied.append(plan.step_id)
        oldest = self.applied[0]
        for req_id, sreq in plan.score.items():
            scored = self.requests.open(req_id).scored
            scored[plan.step_id] = sreq.evictable_below
            for old in [s for s in scored if s < oldest]:
                del scored[old]

    def _mask_suspects(self, gone: set[str]) -> tuple[Masked, ...]:
        """Without a usable plan, the scheduler may have freed (and reallocated) blocks
        of the requests its last ``k`` applied plans scored (on any of their replies):
        hide their evictable blocks for this step."""
        runner = self.runner
        assert runner is not None
        if not self.applied:
            return ()
        oldest = self.applied[0]
        masked = []
        for req_id, req in self.requests.items():
            below = max((b for s, b in req.scored.items() if s >= oldest), default=0)
            if req_id in gone or below <= self.sink_blocks:
                continue
            ids = runner.logical_row(req_id)
            if ids is None:
                continue
            idxs = tuple(j for j in range(self.sink_blocks, min(below, len(ids)))
                         if j not in req.evicted)
            if not idxs:
                continue
            original = tuple(int(ids[j]) for j in idxs)
            runner.set_entries(req_id, idxs, [NULL_BLOCK_ID] * len(idxs))
            masked.append(Masked(req_id, idxs, original))
        return tuple(masked)

    # -- after the forward -------------------------------------------------------------
    def finish_forward(self, step: Step) -> PendingScores | None:
        """Score the requests ``step``'s plan marks as due (after the forward, before
        :meth:`end_step`): the scores on their way to the host, on the output rank."""
        compaction = self.compactor.result()
        return self.scorer.score(step.plan, None if compaction is None else compaction.batch,
                                 capture_failed=self.ring.capture_failed)

    # -- the reply ---------------------------------------------------------------------
    def reply_token(self, step: Step, pending: PendingScores | None) -> ReplyToken:
        """What ``step``'s reply needs, taken now: its acknowledgement, its pending
        scores (from :meth:`finish_forward`) and the faults seen so far
        (:meth:`ReplyToken.reply` builds it)."""
        return ReplyToken(ack=step.ack, pending=pending, faults=self.fault.take(),
                          scorer=self.scorer)

    def end_step(self, step: Step) -> None:
        """Restore entries masked for ``step`` only; disarm the parts."""
        if self.current is step:
            self.compactor.end()
            self.ring.end()
            self.current = None
        if self.runner is None:
            return
        for m in step.masked:
            req = self.requests.get(m.req_id)
            done = set() if req is None else req.evicted
            keep = [(j, v) for j, v in zip(m.idxs, m.original) if j not in done]
            if keep:
                self.runner.set_entries(m.req_id, [j for j, _ in keep], [v for _, v in keep])
