"""The worker's eviction state: the plan applied, the step's parts wired, the reply built.

One object per worker process, owned by :class:`~nexus_vllm.integration.worker.worker.NexusWorker`.
It is the same code on every backend, device and model runner (the runner is reached only
through its adapter, ``integration/compat/runners.py``): on CPU (tested end to end in CI) and on
CUDA. It owns three parts, each fed to the hook that uses it and handed the step
explicitly (``integration/worker/worker_step.py``):

* :class:`~nexus_vllm.integration.worker.compaction.Compactor`, fed to the metadata builders;
* :class:`~nexus_vllm.integration.worker.query_ring.QueryRing`, fed to the attention impls;
* :class:`~nexus_vllm.integration.worker.block_scorer.BlockScorer`, run after the forward.

One step (``NexusWorker.execute_model``):

1. :meth:`WorkerEvictionState.begin_step` checks the
   :class:`~nexus_vllm.integration.protocol.StepPlan` (fail-closed, see ``step_plan``),
   writes the null block id over newly evicted entries through the runner adapter, keeps a
   per-request set of evicted logical blocks (what compaction reads) and opens the step;
2. vLLM builds attention metadata: the compactor rewrites it for rows with evicted
   blocks, with no device-to-host read;
3. during the forward, the ring copies the newest queries of tracked requests;
4. :meth:`finish_forward` has the scorer score every request due (all scored layers at
   once), reduce over tensor-parallel ranks, gather the pipeline stages' parts on the
   last stage and start one non-blocking host copy;
5. :meth:`reply_token` (after sampling) takes what the step's reply needs (its
   acknowledgement, the pending scores, the faults so far) and :meth:`end_step` restores
   any temporarily masked entries and closes the step; :meth:`ReplyToken.reply` then
   waits for the copy and builds the :class:`~nexus_vllm.integration.protocol.WorkerReply`,
   at once, or under async scheduling when vLLM takes the step's output, after the next
   step has begun. Each step keeps its own state (:class:`~nexus_vllm.integration.worker.
   worker_step.Step`); nothing of it is shared with the next.

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

import os
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from nexus_vllm.integration import faults
from nexus_vllm.integration.compat.runners import RunnerAdapter
from nexus_vllm.integration.compat.vllm_compat import NULL_BLOCK_ID, reset_request_ids
from nexus_vllm.integration.protocol import ScoreRequest, StepPlan, WorkerReply, read_step
from nexus_vllm.integration.worker.block_scorer import BlockScorer, PendingScores
from nexus_vllm.integration.worker.compaction import Compactor
from nexus_vllm.integration.worker.query_ring import QueryRing
from nexus_vllm.integration.worker.wire import RankLayout, StageLinks
from nexus_vllm.integration.worker.worker_step import LayerKeys, SelfCheckError, Step

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.core.sched.output import SchedulerOutput

logger = init_logger(__name__)

__all__ = ["SELF_CHECK_ENV", "LayerKeys", "ReplyToken", "SelfCheckError",
           "WorkerEvictionState", "layer_index"]

_LAYER_INDEX = re.compile(r"\.(\d+)\.")
SELF_CHECK_ENV = "NEXUS_VLLM_SELF_CHECK"


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
    head_reduce : {"mean", "max"}
        How the scored heads and layers combine (``EvictionConfig.head_reduce``).
    steps_in_flight : int
        k, the steps vLLM schedules before the first reply (``max_concurrent_batches``):
        how many applied plans a missed plan's masking covers.
    stages : StageLinks, optional
        Links to the last pipeline stage (needed with pipeline parallelism).
    """

    def __init__(self, *, block_size: int, window: int, max_requests: int,
                 device: torch.device, score_backend: str,
                 layout: RankLayout | None = None, scored_layers: int = 0,
                 head_reduce: str = "mean", steps_in_flight: int = 1,
                 stages: StageLinks | None = None) -> None:
        self.max_requests = int(max_requests)
        self.runner: RunnerAdapter | None = None
        self.fault = faults.FaultLog(logger)
        self.self_check = os.environ.get(SELF_CHECK_ENV, "0") == "1"
        self.compactor = Compactor(block_size=block_size, max_requests=max_requests,
                                   backend=score_backend)
        self.ring = QueryRing(window=window, max_requests=max_requests, device=device,
                              fault=self.fault)
        self.scorer = BlockScorer(self.ring, block_size=block_size,
                                  max_requests=max_requests, device=device,
                                  backend=score_backend, layout=layout or RankLayout(),
                                  scored_layers=scored_layers, head_reduce=head_reduce,
                                  fault=self.fault, self_check=self.self_check,
                                  stages=stages)
        # Logical block indices nulled per request (shared with the compactor).
        self.evicted: dict[str, set[int]] = self.compactor.evicted
        self.last_step = 0
        # The score maps of the last k plans applied: the scheduler may free blocks of
        # these requests on any of their replies before this worker hears of the nulls.
        self.recent_scores: deque[dict[str, ScoreRequest]] = deque(
            maxlen=max(1, int(steps_in_flight)))
        self.sink_blocks = 1
        self.step: Step | None = None

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
        self.compactor.batch_req_ids = runner.batch_req_ids
        self.ring.bind(scored)

    def ring_bytes(self) -> int:
        return self.ring.nbytes()

    def _open(self, step: Step | None) -> None:
        self.step = self.compactor.step = self.ring.step = step

    # -- the plan ----------------------------------------------------------------------
    def begin_step(self, scheduler_output: SchedulerOutput, plan: StepPlan | None) -> Step:
        """Apply ``plan`` to the runner's block tables and open one step."""
        runner = self.runner
        assert runner is not None, "bind_layers() first"
        if self.step is not None:  # a previous step raised before end_step()
            self.end_step(self.step)
        runner.observe(scheduler_output)
        resets = reset_request_ids(scheduler_output)
        gone = set(scheduler_output.finished_req_ids) | resets
        # This step's own plan (the stamp on the output; an unstamped output's plan is
        # taken as its own), and newer than the last one applied.
        own = read_step(scheduler_output)
        usable = (plan is not None and plan.step_id > self.last_step
                  and (own is None or plan.step_id == own))
        if faults.fires("plan_lost"):
            usable = False
            self.fault("plan_lost", "injected: the step's plan is dropped")
        elif plan is None:
            self.fault("plan_missing", "a step arrived without an eviction plan; masking "
                       "every block the scheduler may have freed for this step")
        elif not usable:
            self.fault("plan_stale", f"plan {plan.step_id} arrived for step {own} after plan "
                       f"{self.last_step}; masking possibly freed blocks for this step")
        elif plan.step_id != self.last_step + 1:
            self.fault("plan_gap", f"plans {self.last_step + 1}..{plan.step_id - 1} never "
                       "arrived; their evictions are resent in this one")

        if usable:
            assert plan is not None
            self.sink_blocks = plan.sink_blocks
            for req_id, idxs in plan.evict.items():
                if req_id in gone:
                    continue
                done = self.evicted.setdefault(req_id, set())
                new = [j for j in idxs if j not in done]
                runner.set_entries(req_id, new, [NULL_BLOCK_ID] * len(new))
                done.update(new)
            self.last_step = plan.step_id
        step = Step(plan=plan if usable else None, tracked=set(),
                    ack=plan.step_id if usable and plan is not None else None)
        if not usable:
            self._mask_suspects(step, gone)
        for req_id in gone:
            self._forget(req_id)
        if usable:
            assert plan is not None
            self.recent_scores.append(dict(plan.score))
            step.tracked = set(plan.track)
        else:
            # Keep the windows of known requests continuous through a faulty step.
            step.tracked = set(self.ring.slots)
        for req_id in step.tracked:
            self.ring.track(req_id)
        self._open(step)
        return step

    def _mask_suspects(self, step: Step, gone: set[str]) -> None:
        """Without a usable plan, the scheduler may have freed (and reallocated) blocks
        of the requests its last ``k`` applied plans scored (on any of their replies):
        hide their evictable blocks for this step."""
        runner = self.runner
        assert runner is not None
        below: dict[str, int] = {}
        for scores in self.recent_scores:
            for req_id, sreq in scores.items():
                below[req_id] = max(below.get(req_id, 0), sreq.evictable_below)
        for req_id, evictable_below in below.items():
            if req_id in gone:
                continue
            done = self.evicted.get(req_id, set())
            ids = runner.logical_row(req_id)
            if ids is None:
                continue
            idxs = [j for j in range(self.sink_blocks, min(evictable_below, len(ids)))
                    if j not in done]
            if not idxs:
                continue
            original = [int(ids[j]) for j in idxs]
            runner.set_entries(req_id, idxs, [NULL_BLOCK_ID] * len(idxs))
            step.masked.append((req_id, idxs, original))
            step.masked_counts[req_id] = len(idxs)

    def _forget(self, req_id: str) -> None:
        self.evicted.pop(req_id, None)
        for scores in self.recent_scores:
            scores.pop(req_id, None)
        self.ring.forget(req_id)

    # -- the hooks (each part is also reachable directly) -------------------------------
    def compact(self, cm: CommonAttentionMetadata) -> CommonAttentionMetadata:
        """``cm`` with evicted blocks compacted out (see ``compaction.Compactor``)."""
        return self.compactor.compact(cm)

    def capture(self, layer: int, query: torch.Tensor) -> None:
        """Copy this layer's queries of tracked requests into the ring."""
        self.ring.capture(layer, query)

    def check_keys(self, layer: int, key: torch.Tensor) -> None:
        """Self-check: the layer's key view holds the keys it was just given."""
        self.ring.check_keys(layer, key)

    def finish_forward(self) -> None:
        """Score the requests due (after the forward); start the host copy."""
        self.scorer.score(self.step)

    # -- the reply ---------------------------------------------------------------------
    def reply_token(self, step: Step) -> ReplyToken:
        """What ``step``'s reply needs, taken now: its acknowledgement, its pending
        scores and the faults seen so far (:meth:`ReplyToken.reply` builds it)."""
        return ReplyToken(ack=step.ack, pending=step.pending, faults=self.fault.take(),
                          scorer=self.scorer)

    def reply(self, step: Step) -> WorkerReply:
        """``step``'s reply, now (waits for the score copy started in finish_forward)."""
        return self.reply_token(step).reply()

    def end_step(self, step: Step) -> None:
        """Restore entries masked for ``step`` only; close it."""
        if self.step is step:
            self._open(None)
        if self.runner is None:
            return
        for req_id, idxs, original in step.masked:
            done = self.evicted.get(req_id, set())
            keep = [(j, v) for j, v in zip(idxs, original) if j not in done]
            if keep:
                self.runner.set_entries(req_id, [j for j, _ in keep], [v for _, v in keep])
