"""Scoring after the forward: every request due, all scored layers, one call; reduction
over tensor-parallel ranks, and the pipeline stages' parts sent to the last stage.

:meth:`BlockScorer.score` runs after vLLM's forward: it gathers, for every request the plan
marks as due, each kind of evidence its policy reads (``ScoreRequest.kinds``), with that
kind's registered worker gatherer (:mod:`nexus_vllm.core.evidence`) over the query ring
and this worker's scored layers' keys, into one float vector laid out as the registry
says (the kinds reduced by their maximum first, then those summed, then a validity flag),
reduces it over the tensor-parallel ranks (a
failure on one rank drops the event on every rank instead of deadlocking). With pipeline
parallelism each stage holds some of the layers: TP rank 0 of every other stage sends its
stage's part to the last stage (non-blocking, on a communicator of its own:
``vllm_compat.StageLink``), whose TP rank 0 (where vLLM takes the step's output) adds
them up; no stage waits for a later one, as a PP all-reduce on every scored step would
make it. The output rank starts one non-blocking copy to the host and returns the step's
:class:`PendingScores`; :meth:`BlockScorer.collect` (after sampling, or later under async
scheduling) waits for that copy and returns the per-request evidence for the reply.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nexus_vllm.core import Rotary, cdiv, evidence_kind
from nexus_vllm.core.evidence import PagedBatch
from nexus_vllm.integration.compat.vllm_compat import tp_all_reduce
from nexus_vllm.integration.protocol import StepPlan
from nexus_vllm.integration.worker.query_ring import QueryRing
from nexus_vllm.integration.worker.wire import (
    Due,
    RankLayout,
    Reduce,
    Segment,
    StageLinks,
    add_stage_parts,
    reduce_over_tp,
    wire_layout,
)
from nexus_vllm.integration.worker.worker_step import Batch, SelfCheckError, Staging
from nexus_vllm.kernels import block_attention_mass_paged_layers

__all__ = ["BlockScorer", "GatheredEvidence", "PendingScores"]

_SELF_CHECK_SCORING_STEPS = 4


class _Timer:
    """Device time of a region: CUDA events on a GPU, wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
        self._t0 = self._t1 = 0.0

    def start(self) -> None:
        if self._cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._cuda:
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def seconds(self) -> float:
        """Call after the region's work has completed (the reply's host read)."""
        if self._cuda:
            return float(self._start.elapsed_time(self._end)) / 1e3
        return self._t1 - self._t0


@dataclass
class PendingScores:
    """Scores on their way to the host (non-blocking copy started in ``score``).

    ``host`` is one float32 vector: each kind's segment (``segments``), then the validity
    flag (the number of ranks that succeeded).
    """

    segments: list[Segment]
    host: torch.Tensor
    done: torch.cuda.Event | None  # recorded after the copy (CUDA only)
    timer: _Timer
    world: int


@dataclass(frozen=True)
class GatheredEvidence:
    """What one step's scoring produced for the reply."""

    evidence: dict[str, dict[str, np.ndarray]]  # kind -> req_id -> array over live blocks
    seconds: float
    faults: dict[str, int] = field(default_factory=dict)  # seen while collecting


class BlockScorer:
    """Scores the requests due each step.

    Parameters
    ----------
    ring : QueryRing
        The queries (and the scored layers' keys, bound to it).
    block_size : int
    max_requests : int
    device : torch.device
    backend : str
        ``nexus_vllm.kernels`` backend of the scoring kernel.
    layout : RankLayout
        This worker's TP rank and pipeline stage.
    scored_layers : int
        Scored layers of the whole model (all stages): each stage's sum is divided by it,
        so the sum over stages is the mean over every scored layer. 0: as many as this
        worker's ring holds (one stage).
    attention_reduce : {"mean", "max"}
        How heads and layers combine (``EvictionConfig.attention_reduce``): a mean (summed over
        ranks), or a maximum (reduced by max over ranks; the scheduler renormalises each
        row, ``Evidence.from_gathered``).
    fault : callable
        ``(kind, message, exc=...)``: count and log a fault.
    self_check : bool
        Recompute the first scoring steps with the torch reference and compare.
    tp_reduce : callable, optional
        Reduce a tensor over the TP group (default: vLLM's).
    stages : StageLinks, optional
        Links to the last pipeline stage (needed when ``layout.pp_size > 1``).
    rotary : Rotary, optional
        The model's rotary table (kinds that un-rotate queries need it).
    """

    # Sends to the last stage not yet known complete, beyond which the oldest is waited
    # for (each keeps its tensor alive until sent).
    _MAX_SENDS = 8

    def __init__(self, ring: QueryRing, *, block_size: int, max_requests: int,
                 device: torch.device, backend: str, layout: RankLayout,
                 fault: Callable[..., None], self_check: bool, scored_layers: int = 0,
                 attention_reduce: str = "mean", tp_reduce: Reduce = tp_all_reduce,
                 stages: StageLinks | None = None, rotary: Rotary | None = None) -> None:
        if layout.pp_size > 1 and stages is None:
            raise ValueError("pipeline parallelism needs links to the last stage")
        self.ring = ring
        self.rotary = rotary
        self.attention_reduce = attention_reduce
        self.block_size = int(block_size)
        self.device = device
        self.backend = backend
        self.layout = layout
        self.tp_size = layout.tp_size
        self.scored_layers = int(scored_layers)
        self._tp_reduce = tp_reduce
        self.stages = stages
        self._sends: deque[tuple[Any, torch.Tensor]] = deque()
        self._fault = fault
        self.self_check = self_check
        self._checks = 0
        tokens = int(max_requests) * ring.window
        self._qidx = Staging(tokens, device)
        # The batch rows of one kind's requests (put again for each kind, in turn).
        self._rows = Staging(int(max_requests), device)

    # -- after the forward ---------------------------------------------------------------
    def score(self, plan: StepPlan | None, batch: Batch | None, *,
              capture_failed: bool = False) -> PendingScores | None:
        """Gather the evidence of the requests ``plan`` marks as due in ``batch`` (after
        the forward); on the output rank, start the host copy and return the scores on
        their way (None elsewhere, or when nothing was due).

        Parameters
        ----------
        plan : StepPlan or None
            The step's usable plan (None: nothing is scored).
        batch : Batch or None
            The batch attention saw (``Compaction.batch``; None: no metadata was built).
        capture_failed : bool
            The query ring's capture failed this step: the event is dropped on every rank.
        """
        if plan is None or not plan.score or batch is None:
            return None
        due = self._due(plan, batch)
        if not due:
            return None
        segments, max_prefix = wire_layout(due, self.attention_reduce)
        size = sum(seg.size for seg in segments)
        flat = torch.zeros(size + 1, dtype=torch.float32, device=self.device)
        timer = _Timer(self.device)
        timer.start()
        try:
            if capture_failed:
                raise RuntimeError("query capture failed in this step")
            self._gather(batch, segments, flat)
            flat[-1] = 1.0
        except SelfCheckError:
            raise
        except Exception:
            flat.zero_()
            self._fault("score_error", "block scoring failed; dropping this step's "
                        "eviction events on every rank", exc=True)
        timer.stop()
        # Every rank of every stage reaches the TP reduction and the stage links, failed
        # or not (no deadlock); the event is used only if every rank's flag made it (sum
        # == TP x PP size).
        flat = reduce_over_tp(flat, self.tp_size, self._tp_reduce, max_prefix=max_prefix)
        layout = self.layout
        total: torch.Tensor | None = flat
        if layout.pp_size > 1:
            total = self._join_stages(flat, max_prefix)
        if not layout.is_output or total is None:
            return None
        if self.device.type == "cuda":
            host = torch.empty(total.shape, dtype=total.dtype, pin_memory=True)
            host.copy_(total, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host, done = total, None
        return PendingScores(segments=segments, host=host, done=done, timer=timer,
                             world=layout.world)

    def _gather(self, batch: Batch, segments: list[Segment], flat: torch.Tensor) -> None:
        """Each kind's gatherer into its segment of ``flat`` ``[size + 1]``; raises on
        failure (:meth:`score` absorbs it as ``score_error``)."""
        # A stage without scored layers adds zeros (it still joins the reduction).
        if not self.ring.layer_keys:
            return
        for seg in segments:
            paged = self._paged_batch(batch, seg)
            evidence_kind(seg.kind).gather_paged(paged, seg.view(flat))
            if seg.kind == "mass":
                self._self_check_mass(paged, seg.view(flat))

    def _paged_batch(self, batch: Batch, seg: Segment) -> PagedBatch:
        """What a gatherer reads for one kind's requests: their query rows in time order
        (rows before a request's start are padding, outside its ``rows``), block tables,
        lengths and positions."""
        ring = self.ring.ring
        assert ring is not None
        layers, slots, w, heads, dim = ring.shape
        r = len(seg.due)
        w_s = max(1, max(d.window for d in seg.due))
        qidx = np.empty((r, w_s), dtype=np.int64)
        ends = np.empty(r, dtype=np.int64)
        for i, d in enumerate(seg.due):
            ends[i] = int(batch.logical_lens[d.row])
            qidx[i] = (self.ring.rows(d.req_id, int(ends[i]), w_s) if d.window
                       else np.zeros(w_s, dtype=np.int64))
        rows_dev = self._rows.put(np.array([d.row for d in seg.due], dtype=np.int64))
        qidx_dev = self._qidx.put(qidx.reshape(-1))
        q = ring.view(layers, slots * w, heads, dim).index_select(1, qidx_dev)
        positions = torch.from_numpy(ends[:, None] - w_s + np.arange(w_s)[None, :])
        return PagedBatch(
            queries=q.view(layers, r, w_s, heads, dim),
            rows=torch.tensor([max(1, d.window) for d in seg.due], device=self.device),
            query_positions=positions.clamp_(min=0).to(self.device),
            next_positions=torch.from_numpy(ends).to(self.device),
            key_caches=[layer.key_cache for layer in self.ring.layer_keys],
            tables=batch.tables.index_select(0, rows_dev)[:, :seg.cols],
            seq_lens=batch.seq_lens.index_select(0, rows_dev),
            attention_reduce=self.attention_reduce, layers_divisor=self._layers_divisor(),
            paged_mass=functools.partial(block_attention_mass_paged_layers,
                                         backend=self.backend),
            rotary=self.rotary)

    def _self_check_mass(self, paged: PagedBatch, out: torch.Tensor) -> None:
        """``NEXUS_VLLM_SELF_CHECK``: the first scoring steps' mass recomputed with the
        torch reference of the kernel."""
        if not self.self_check or self._checks >= _SELF_CHECK_SCORING_STEPS:
            return
        self._checks += 1
        ref = torch.zeros_like(out)
        torch_mass = functools.partial(block_attention_mass_paged_layers, backend="torch")
        evidence_kind("mass").gather_paged(dataclasses.replace(paged, paged_mass=torch_mass),
                                           ref)
        err = float((ref - out).abs().max())
        if err > 1e-3:
            raise SelfCheckError(f"nexus-vllm self-check: the scoring kernel differs "
                                 f"from the torch reference by {err:.3g}")

    def _join_stages(self, flat: torch.Tensor, max_prefix: int) -> torch.Tensor | None:
        """TP rank 0 of a stage before the last sends its part to the last stage (and
        moves on); the output rank receives every part and adds them up (on CUDA the
        wait orders the stream only). Returns the total on the output rank."""
        layout, stages = self.layout, self.stages
        assert stages is not None
        if layout.tp_rank != 0:
            return None
        if not layout.is_output:
            while self._sends and (len(self._sends) >= self._MAX_SENDS
                                   or self._sends[0][0].is_completed()):
                work, _ = self._sends.popleft()
                work.wait()
            self._sends.append((stages.send_to_last(flat), flat))
            return None
        parts = [torch.empty_like(flat) for _ in range(layout.pp_size - 1)]
        works = [stages.receive_from(stage, part) for stage, part in enumerate(parts)]
        for work in works:
            work.wait()
        return add_stage_parts(flat, parts, max_prefix=max_prefix)

    def _due(self, plan: StepPlan, batch: Batch) -> list[Due]:
        """The requests to score now (those whose policy reads the worker's evidence)."""
        due = []
        for i, req_id in enumerate(batch.req_ids):
            sreq = plan.score.get(req_id)
            if sreq is None or not sreq.kinds:
                continue
            end = int(batch.logical_lens[i])
            window = 0
            if any(evidence_kind(k).reads_queries for k in sreq.kinds):
                window = min(sreq.window, self.ring.window, self.ring.valid_rows(req_id, end))
                if window <= 0:
                    self._fault("window_missing", "a request due for scoring has no "
                                "captured queries; its event is skipped")
                    continue
            nblk = cdiv(end, self.block_size)
            if nblk != sreq.num_logical_blocks:
                self._fault("plan_mismatch", "the plan's block count disagrees with the "
                            "batch; the event is skipped")
                continue
            due.append(Due(row=i, req_id=req_id, window=window,
                            live=nblk - int(batch.evicted_counts[i]),
                            kinds=frozenset(sreq.kinds)))
        return due

    def _layers_divisor(self) -> int:
        """Scored layers of the model x TP ranks: the sum over every rank of every stage
        is then the mean over all scored layers and all heads."""
        return (self.scored_layers or len(self.ring.layer_keys)) * self.tp_size

    # -- after sampling ------------------------------------------------------------------
    def collect(self, pending: PendingScores | None) -> GatheredEvidence:
        """A step's evidence by kind and request (waits for the copy :meth:`score`
        started into ``pending``). Touches nothing but ``pending``: under async
        scheduling it runs in vLLM's output thread while the next step runs."""
        evidence: dict[str, dict[str, np.ndarray]] = {}
        seconds = 0.0
        faults: dict[str, int] = {}
        if pending is not None:
            if pending.done is not None:
                pending.done.synchronize()
            seconds = pending.timer.seconds()
            values = pending.host.cpu()
            valid = int(round(float(values[-1])))
            if valid == pending.world:
                for seg in pending.segments:
                    part = seg.view(values).numpy()
                    per_req = evidence.setdefault(seg.kind, {})
                    for r, d in enumerate(seg.due):
                        # A rows kind keeps the request's own newest rows (rows of maxima
                        # under attention_reduce max: the scheduler's Evidence renormalises).
                        per_req[d.req_id] = (
                            part[r, seg.rows - d.window:, :d.live].copy() if part.ndim == 3
                            else part[r, :d.live].copy())
            elif valid:
                faults["score_error_peer"] = 1
                self._fault("score_error_peer", "block scoring failed on another rank; "
                            "dropping this step's eviction events", count=False)
        return GatheredEvidence(evidence=evidence, seconds=seconds, faults=faults)
