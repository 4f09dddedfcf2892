"""Scheduler <-> worker channel and the worker's per-step eviction state.

Scheduler -> worker: a :class:`StepPlan` rides on the ``SchedulerOutput`` of each step as
the attribute ``nexus_plan`` (in-process with the uni executor; pickled with its
``__dict__`` by the multiprocess executor's message queue). It carries the block-table
entries nulled since the previous step, which requests to score this step, and which
requests to keep query windows for.

Worker -> scheduler: the step's block masses ride back on the ``ModelRunnerOutput`` as the
attribute ``nexus_scores`` (``{req_id: ScoreResult}``).

Ordering: the scheduler frees evicted blocks in ``update_from_output`` of step N; the
plan of step N+1 tells the worker, which nulls the entries before it builds step N+1's
attention metadata, i.e. before any other request can write into a reused block.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "PLAN_ATTR",
    "SCORES_ATTR",
    "ScoreRequest",
    "ScoreResult",
    "StepPlan",
    "WorkerEvictionState",
    "worker_state",
]

PLAN_ATTR = "nexus_plan"
SCORES_ATTR = "nexus_scores"
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class ScoreRequest:
    """Score one request this step.

    Attributes
    ----------
    window : int
        Newest queries (per layer) to score with.
    num_logical_blocks : int
        ``ceil(tokens after this step / block_size)``: the logical block-table length the
        masses refer to.
    prefill : bool
        The step was a prefill chunk (the policy uses its prefill variant).
    """

    window: int
    num_logical_blocks: int
    prefill: bool = False


@dataclass
class StepPlan:
    """What the worker must know for one step (see module docstring).

    Attributes
    ----------
    evict : dict[str, list[int]]
        Logical block indices nulled (and freed) since the previous step, per request.
    score : dict[str, ScoreRequest]
        Requests to score after this step's forward.
    track : list[str]
        Evicting requests in this step: keep their newest queries per layer.
    reset : list[str]
        Requests that restarted from token 0 (preempted and recomputed).
    max_window : int
        Queries kept per request and layer.
    skip_layers : int
        First layers left out of the score (their attention is near uniform).
    """

    evict: dict[str, list[int]] = field(default_factory=dict)
    score: dict[str, ScoreRequest] = field(default_factory=dict)
    track: list[str] = field(default_factory=list)
    reset: list[str] = field(default_factory=list)
    max_window: int = 32
    skip_layers: int = 0


@dataclass(frozen=True)
class ScoreResult:
    """Block masses of one request after one step.

    Attributes
    ----------
    mass : Tensor[W, N] float32
        Attention mass of the W newest queries on the N live blocks (averaged over scored
        layers; rows sum to 1).
    live : list[int]
        Logical block index of each of the N columns (ascending).
    seconds : float
        Worker time spent scoring this request.
    """

    mass: torch.Tensor
    live: list[int]
    seconds: float


class WorkerEvictionState:
    """Per-process worker state: query windows, mass accumulators, the current plan."""

    def __init__(self) -> None:
        self.active = False
        self.any_evicted = False
        self.plan: StepPlan | None = None
        self.runner: Any = None
        self.windows: dict[tuple[str, int], torch.Tensor] = {}
        self._accum: dict[str, tuple[torch.Tensor, int]] = {}
        self._seconds: dict[str, float] = {}
        self._rows: list[tuple[int, str, int, int]] | None = None
        self._layer_index: dict[str, int] = {}

    # -- step lifecycle ----------------------------------------------------------------
    def begin_step(self, runner: Any, plan: StepPlan, finished: set[str]) -> None:
        """Apply the plan's evictions to the runner's block tables; arm the hooks."""
        self.runner = runner
        self.plan = plan
        drop = set(finished) | set(plan.reset)
        if drop:
            self.windows = {k: v for k, v in self.windows.items() if k[0] not in drop}
        for req_id, idxs in plan.evict.items():
            self._null_entries(runner, req_id, idxs)
        self._rows = None
        self._accum.clear()
        self._seconds.clear()
        self.active = bool(plan.track) or self.any_evicted

    def end_step(self) -> dict[str, ScoreResult]:
        """Disarm the hooks; return the finished scores of this step."""
        out: dict[str, ScoreResult] = {}
        plan = self.plan
        if plan is not None:
            for req_id, sreq in plan.score.items():
                acc = self._accum.get(req_id)
                if acc is None:
                    continue
                total, count = acc
                live = self._live_blocks(req_id, sreq.num_logical_blocks)
                if live is None or len(live) != total.shape[1]:
                    continue
                out[req_id] = ScoreResult(
                    mass=(total / count).contiguous(), live=live,
                    seconds=self._seconds.get(req_id, 0.0),
                )
        self.active = False
        self.plan = None
        self._rows = None
        self._accum.clear()
        return out

    def drop_scores(self) -> None:
        """Forget this step's score requests (after a scoring failure)."""
        if self.plan is not None:
            self.plan.score = {}
        self._accum.clear()

    def _null_entries(self, runner: Any, req_id: str, idxs: list[int]) -> None:
        if not idxs:
            return
        state = runner.requests.get(req_id)
        if state is not None:
            ids = state.block_ids[0]
            for j in idxs:
                if j < len(ids):
                    ids[j] = 0
        row = runner.input_batch.req_id_to_index.get(req_id)
        if row is not None:
            table = runner.input_batch.block_table[0].block_table.np
            table[row, idxs] = 0
        self.any_evicted = True

    def _live_blocks(self, req_id: str, num_logical: int) -> list[int] | None:
        state = self.runner.requests.get(req_id) if self.runner is not None else None
        if state is None:
            return None
        ids = state.block_ids[0][:num_logical]
        return [j for j, b in enumerate(ids) if b != 0]

    # -- attention hook ----------------------------------------------------------------
    def layer_index(self, layer_name: str) -> int:
        idx = self._layer_index.get(layer_name)
        if idx is None:
            m = _LAYER_INDEX.search(f".{layer_name}.")
            idx = int(m.group(1)) if m else 0
            self._layer_index[layer_name] = idx
        return idx

    def _tracked_rows(self, query_start_loc: torch.Tensor) -> list[tuple[int, str, int, int]]:
        if self._rows is None:
            assert self.plan is not None
            track = set(self.plan.track)
            req_ids = self.runner.input_batch.req_ids
            qsl = query_start_loc.tolist()
            rows = []
            for row, req_id in enumerate(req_ids[: len(qsl) - 1]):
                if req_id in track:
                    rows.append((row, req_id, int(qsl[row]), int(qsl[row + 1])))
            self._rows = rows
        return self._rows

    def observe(
        self,
        layer_name: str,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_heads: int,
        head_size: int,
    ) -> None:
        """Record this layer's queries of tracked requests; score requests due.

        Parameters
        ----------
        query : Tensor[num_tokens, Hq, D] (or [num_tokens, Hq * D])
        key_cache : Tensor[num_blocks, Hkv, block_size, D] (HND view)
        block_table, seq_lens : the *compacted* attention metadata of this step.
        """
        plan = self.plan
        if plan is None or not plan.track:
            return
        li = self.layer_index(layer_name)
        q_all = query.view(query.shape[0], num_heads, head_size)
        for row, req_id, start, end in self._tracked_rows(query_start_loc):
            if end <= start:
                continue
            new = q_all[max(start, end - plan.max_window): end]
            key = (req_id, li)
            prev = self.windows.get(key)
            win = new if prev is None else torch.cat([prev, new])[-plan.max_window:]
            self.windows[key] = win.detach().clone()
            sreq = plan.score.get(req_id)
            if sreq is None or li < plan.skip_layers:
                continue
            t0 = time.perf_counter()
            mass = self._score(win[-sreq.window:], key_cache, block_table[row],
                               int(seq_lens[row]))
            acc = self._accum.get(req_id)
            if acc is None:
                self._accum[req_id] = (mass, 1)
            elif acc[0].shape == mass.shape:
                self._accum[req_id] = (acc[0] + mass, acc[1] + 1)
            self._seconds[req_id] = self._seconds.get(req_id, 0.0) + time.perf_counter() - t0

    @staticmethod
    def _score(queries: torch.Tensor, key_cache: torch.Tensor, block_row: torch.Tensor,
               seq_len: int) -> torch.Tensor:
        from nexus_vllm.kernels import block_attention_mass_paged

        nblk = -(-seq_len // key_cache.shape[2])
        backend = "torch" if key_cache.device.type == "cpu" else "auto"
        mass = block_attention_mass_paged(
            queries[None], key_cache, block_row[None, :nblk],
            torch.tensor([seq_len], dtype=torch.int64), kv_layout="HND", backend=backend,
        )
        return mass[0, :, :nblk]


_STATE: WorkerEvictionState | None = None


def worker_state() -> WorkerEvictionState:
    """The process's worker eviction state (created on first use)."""
    global _STATE
    if _STATE is None:
        _STATE = WorkerEvictionState()
    return _STATE
