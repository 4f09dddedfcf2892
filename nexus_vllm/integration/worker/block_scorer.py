"""Scoring after the forward: every request due, all scored layers, one call; reduction
over tensor-parallel ranks, and the pipeline stages' parts sent to the last stage.

:meth:`BlockScorer.score` runs after vLLM's forward: it scores every request the plan
marks as due with one ``nexus_vllm.kernels.block_attention_mass_paged_layers`` call over
the query ring and this worker's scored layers' keys (and key norms for policies that
read them), sums the results over the tensor-parallel ranks with a validity flag (a
failure on one rank drops the event on every rank instead of deadlocking). With pipeline
parallelism each stage holds some of the layers: TP rank 0 of every other stage sends its
stage's part to the last stage (non-blocking, on a communicator of its own:
``vllm_compat.StageLink``), whose TP rank 0 (where vLLM takes the step's output) adds
them up; no stage waits for a later one, as a PP all-reduce on every scored step would
make it. The output rank starts one non-blocking copy to the host; the step's
``PendingScores`` ride on its :class:`~nexus_vllm.integration.worker.worker_step.Step`, and
:meth:`BlockScorer.collect` (after sampling, or later under async scheduling) waits for
that copy and returns the per-request evidence for the reply.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from nexus_vllm.core import cdiv
from nexus_vllm.integration import faults
from nexus_vllm.integration.compat.vllm_compat import tp_all_reduce
from nexus_vllm.integration.worker.query_ring import QueryRing
from nexus_vllm.integration.worker.worker_step import Batch, SelfCheckError, Staging, Step

__all__ = ["BlockScorer", "Evidence", "PendingScores", "RankLayout", "StageLinks",
           "add_stage_parts", "reduce_over_tp"]

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


@dataclass(frozen=True)
class RankLayout:
    """Where one worker sits in its engine's tensor- x pipeline-parallel grid.

    Attributes
    ----------
    tp_rank, tp_size : int
        Tensor-parallel rank and size (each rank holds some query and KV heads).
    pp_rank, pp_size : int
        Pipeline stage and number of stages (each stage holds some decoder layers).
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        for name, rank, size in (("tp", self.tp_rank, self.tp_size),
                                 ("pp", self.pp_rank, self.pp_size)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name}_rank {rank} is not in [0, {name}_size={size})")

    @property
    def world(self) -> int:
        """Ranks that score each step (every TP rank of every stage)."""
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        """vLLM's rank order inside one engine: stage-major, TP rank within a stage."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_output(self) -> bool:
        """TP rank 0 of the last stage: the worker whose output vLLM's executors read."""
        return self.tp_rank == 0 and self.pp_rank == self.pp_size - 1


# (tensor, op) -> the tensor reduced over a group, out of place; op is "sum" or "max".
Reduce = Callable[[torch.Tensor, str], torch.Tensor]


class StageLinks(Protocol):
    """Point-to-point links from each pipeline stage to the last one
    (``vllm_compat.StageLink`` in a server)."""

    def send_to_last(self, t: torch.Tensor) -> Any:
        """Start sending ``t`` to the last stage; a work handle (``is_completed``,
        ``wait``)."""

    def receive_from(self, stage: int, out: torch.Tensor) -> Any:
        """Start receiving stage ``stage``'s tensor into ``out``; a work handle."""


def reduce_over_tp(flat: torch.Tensor, tp_size: int, tp_reduce: Reduce, *,
                   max_prefix: int = 0) -> torch.Tensor:
    """Sum ``flat`` over the TP ranks of this stage (out of place); its first
    ``max_prefix`` values are reduced by their maximum instead.

    Every TP rank must call this for the same steps with the same shape, failed or not.
    Each rank holds some heads, so a sum of each rank's share is the mean over the
    stage's heads, and a maximum of each rank's maximum its maximum (``head_reduce:
    max``).

    Parameters
    ----------
    flat : Tensor [n] float32
        This rank's masses, key norms and validity flag (see ``PendingScores``).
    tp_size : int
    tp_reduce : callable
        ``(tensor, op)``: reduce over the TP group (vLLM's in a server).
    max_prefix : int
        Leading values reduced by ``max`` (the masses under ``head_reduce: max``); the
        rest (key norms, the flag) are summed.
    """
    if tp_size == 1:
        return flat
    if max_prefix:
        return torch.cat([tp_reduce(flat[:max_prefix], "max"),
                          tp_reduce(flat[max_prefix:], "sum")])
    return tp_reduce(flat, "sum")


def add_stage_parts(flat: torch.Tensor, parts: list[torch.Tensor], *,
                    max_prefix: int = 0) -> torch.Tensor:
    """The last stage's ``flat`` combined with the other stages' ``parts`` (each stage's
    sum over its TP ranks): summed, the first ``max_prefix`` values by their maximum.
    Each stage holds some layers, so this is the model's mean (or maximum) over every
    scored layer, and the flag counts every rank that scored."""
    out = flat.clone()
    for part in parts:
        out[max_prefix:] += part[max_prefix:]
        if max_prefix:
            torch.maximum(out[:max_prefix], part[:max_prefix], out=out[:max_prefix])
    return out


@dataclass(frozen=True)
class _Due:
    """One request to score this step."""

    row: int  # batch row
    req_id: str
    window: int  # query rows (0: the policy reads no mass)
    live: int  # live blocks
    norms: bool  # the policy reads key norms


@dataclass
class PendingScores:
    """Scores on their way to the host (non-blocking copy started in ``score``).

    ``host`` is one float32 vector: the masses ``[R_mass, W_s, N_max]``, then the key
    norms ``[R_norms, N_max]``, then the validity flag (the number of ranks that
    succeeded).
    """

    mass_due: list[_Due]
    norm_due: list[_Due]
    rows: int  # W_s, rows computed per request
    cols: int  # N_max, columns computed per request
    host: torch.Tensor
    done: torch.cuda.Event | None  # recorded after the copy (CUDA only)
    timer: _Timer
    world: int


@dataclass(frozen=True)
class Evidence:
    """What one step's scoring produced for the reply."""

    masses: dict[str, np.ndarray]  # req_id -> [W, live blocks]
    key_norms: dict[str, np.ndarray]  # req_id -> [live blocks]
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
    head_reduce : {"mean", "max"}
        How heads and layers combine (``EvictionConfig.head_reduce``): a mean (summed over
        ranks), or a maximum (reduced by max over ranks; the scheduler renormalises each
        row, ``Evidence.from_scores``).
    fault : callable
        ``(kind, message, exc=...)``: count and log a fault.
    self_check : bool
        Recompute the first scoring steps with the torch reference and compare.
    tp_reduce : callable, optional
        Reduce a tensor over the TP group (default: vLLM's).
    stages : StageLinks, optional
        Links to the last pipeline stage (needed when ``layout.pp_size > 1``).
    """

    # Sends to the last stage not yet known complete, beyond which the oldest is waited
    # for (each keeps its tensor alive until sent).
    _MAX_SENDS = 8

    def __init__(self, ring: QueryRing, *, block_size: int, max_requests: int,
                 device: torch.device, backend: str, layout: RankLayout,
                 fault: Callable[..., None], self_check: bool, scored_layers: int = 0,
                 head_reduce: str = "mean", tp_reduce: Reduce = tp_all_reduce,
                 stages: StageLinks | None = None) -> None:
        if layout.pp_size > 1 and stages is None:
            raise ValueError("pipeline parallelism needs links to the last stage")
        self.ring = ring
        self.head_reduce = head_reduce
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
        # The batch rows of the mass requests, then those of the key-norm requests: a
        # request whose policy reads both (Nexus with knorm_prior > 0) is in each list.
        self._rows = Staging(2 * int(max_requests), device)

    # -- after the forward ---------------------------------------------------------------
    def score(self, step: Step | None) -> None:
        """Score the requests due (after the forward); on the output rank, start the host
        copy (``step.pending``)."""
        if step is None:
            return
        step.pending = None
        if step.plan is None or not step.plan.score or step.batch is None:
            return
        due = self._due(step)
        if not due:
            return
        batch = step.batch
        mass_due = [d for d in due if d.window]
        norm_due = [d for d in due if d.norms]
        w_s = max((d.window for d in mass_due), default=0)
        n_max = max(d.live for d in due)
        r_m, r_n = len(mass_due), len(norm_due)
        # Query rows of each request in time order (rows before its start are dropped with
        # the other unused rows on the host).
        qidx = np.empty((r_m, w_s), dtype=np.int64)
        for r, d in enumerate(mass_due):
            qidx[r] = self.ring.rows(d.req_id, int(batch.logical_lens[d.row]), w_s)
        n_mass = r_m * w_s * n_max
        flat = torch.zeros(n_mass + r_n * n_max + 1, dtype=torch.float32, device=self.device)
        mass_out = flat[:n_mass].view(r_m, w_s, n_max)
        norm_out = flat[n_mass:-1].view(r_n, n_max)
        timer = _Timer(self.device)
        timer.start()
        try:
            if faults.fires("score_error", rank=self.layout.rank):
                raise RuntimeError("injected scoring failure")
            if step.capture_failed:
                raise RuntimeError("query capture failed in this step")
            rows_dev = self._rows.put(np.array([d.row for d in mass_due + norm_due],
                                               dtype=np.int64))
            qidx_dev = self._qidx.put(qidx.reshape(-1))
            # A stage without scored layers adds zeros (it still joins the reduction).
            local = bool(self.ring.layer_keys)
            if r_m and local:
                self._score_into(mass_out, batch, rows_dev[:r_m], qidx_dev, n_max,
                                 self.backend)
            if r_n and local:
                self._key_norms_into(norm_out, batch, rows_dev[r_m:], n_max)
            if r_m and local and self.self_check and self._checks < _SELF_CHECK_SCORING_STEPS:
                self._checks += 1
                ref = torch.zeros_like(mass_out)
                self._score_into(ref, batch, rows_dev[:r_m], qidx_dev, n_max, "torch")
                err = float((ref - mass_out).abs().max())
                if err > 1e-3:
                    raise SelfCheckError(f"nexus-vllm self-check: the scoring kernel differs "
                                         f"from the torch reference by {err:.3g}")
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
        max_prefix = n_mass if self.head_reduce == "max" else 0
        flat = reduce_over_tp(flat, self.tp_size, self._tp_reduce, max_prefix=max_prefix)
        layout = self.layout
        total: torch.Tensor | None = flat
        if layout.pp_size > 1:
            total = self._join_stages(flat, max_prefix)
        if not layout.is_output or total is None:
            return
        if self.device.type == "cuda":
            host = torch.empty(total.shape, dtype=total.dtype, pin_memory=True)
            host.copy_(total, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host, done = total, None
        step.pending = PendingScores(mass_due=mass_due, norm_due=norm_due, rows=w_s,
                                     cols=n_max, host=host, done=done, timer=timer,
                                     world=layout.world)

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

    def _due(self, step: Step) -> list[_Due]:
        """The requests to score now (those whose policy reads the worker's evidence)."""
        assert step.plan is not None and step.batch is not None
        batch = step.batch
        due = []
        for i, req_id in enumerate(batch.req_ids):
            sreq = step.plan.score.get(req_id)
            if sreq is None or not (sreq.needs_mass or sreq.needs_key_norms):
                continue
            end = int(batch.logical_lens[i])
            window = 0
            if sreq.needs_mass:
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
            due.append(_Due(row=i, req_id=req_id, window=window,
                            live=nblk - int(batch.evicted_counts[i]),
                            norms=sreq.needs_key_norms))
        return due

    def _score_into(self, out: torch.Tensor, batch: Batch, rows: torch.Tensor,
                    qidx: torch.Tensor, n_max: int, backend: str) -> None:
        """Every scored layer for all requests due in one call, into ``out``: this rank's
        share of the mean over the model's layers and heads, or its maximum over them."""
        from nexus_vllm.kernels import block_attention_mass_paged_layers

        ring = self.ring.ring
        assert ring is not None
        r_due, w_s, _ = out.shape
        layers, slots, w, heads, dim = ring.shape
        tables = batch.tables.index_select(0, rows)[:, :n_max]
        lens = batch.seq_lens.index_select(0, rows)
        q = ring.view(layers, slots * w, heads, dim).index_select(1, qidx)
        keys = self.ring.layer_keys
        block_attention_mass_paged_layers(
            q.view(layers, r_due, w_s, heads, dim), [layer.key_cache for layer in keys],
            tables, lens, kv_layout="HND", backend=backend, out=out,
            head_reduce=self.head_reduce)
        if self.head_reduce == "mean":
            out.div_(self._layers_divisor())

    def _key_norms_into(self, out: torch.Tensor, batch: Batch, rows: torch.Tensor,
                        n_max: int) -> None:
        """Mean key L2 norm of each live block (over its tokens, the KV heads and the
        scored layers) into ``out [R, n_max]``, as the transformers path computes it."""
        tables = batch.tables.index_select(0, rows)[:, :n_max].long()
        lens = batch.seq_lens.index_select(0, rows).long()
        r = out.shape[0]
        keys = self.ring.layer_keys
        total: torch.Tensor | None = None
        for layer in keys:
            cache = layer.key_cache  # [nb, Hkv, bs, D]
            blocks = cache.index_select(0, tables.reshape(-1)).float()
            per_token = blocks.norm(dim=-1).mean(dim=1).view(r, n_max, -1)  # [R, n, bs]
            total = per_token if total is None else total + per_token
        assert total is not None
        bs = total.shape[-1]
        pos = torch.arange(n_max * bs, device=total.device).view(1, n_max, bs)
        valid = (pos < lens[:, None, None]).to(total.dtype)
        per_block = (total * valid).sum(-1) / valid.sum(-1).clamp_(min=1.0)
        out.copy_(per_block.div_(self._layers_divisor()))

    def _layers_divisor(self) -> int:
        """Scored layers of the model x TP ranks: the sum over every rank of every stage
        is then the mean over all scored layers and all heads."""
        return (self.scored_layers or len(self.ring.layer_keys)) * self.tp_size

    # -- after sampling ------------------------------------------------------------------
    def collect(self, pending: PendingScores | None) -> Evidence:
        """A step's evidence (waits for the copy :meth:`score` started into
        ``pending``). Touches nothing but ``pending``: under async scheduling it runs
        in vLLM's output thread while the next step runs."""
        masses: dict[str, np.ndarray] = {}
        norms: dict[str, np.ndarray] = {}
        seconds = 0.0
        faults: dict[str, int] = {}
        if pending is not None:
            if pending.done is not None:
                pending.done.synchronize()
            seconds = pending.timer.seconds()
            values = pending.host.cpu().numpy()
            valid = int(round(float(values[-1])))
            if valid == pending.world:
                n_mass = len(pending.mass_due) * pending.rows * pending.cols
                block = values[:n_mass].reshape(len(pending.mass_due), pending.rows,
                                                pending.cols)
                for r, d in enumerate(pending.mass_due):
                    # Rows of maxima under head_reduce max: the scheduler renormalises
                    # them and keeps their totals (Evidence.from_scores).
                    masses[d.req_id] = block[r, pending.rows - d.window:, :d.live].copy()
                per_block = values[n_mass:-1].reshape(len(pending.norm_due), pending.cols)
                for r, d in enumerate(pending.norm_due):
                    norms[d.req_id] = per_block[r, :d.live].copy()
            elif valid:
                faults["score_error_peer"] = 1
                self._fault("score_error_peer", "block scoring failed on another rank; "
                            "dropping this step's eviction events", count=False)
        return Evidence(masses=masses, key_norms=norms, seconds=seconds, faults=faults)
