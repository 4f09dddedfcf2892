"""Reads vLLM's own block lists after a ``schedule()``: what each request held in the pool
against the bound admission reserved for it.

An instrument for the bound's benchmark (``benchmarks/serving/pool_peaks.py``) and tests,
not a production part: it counts every entry of every KV cache group's list (the
plugin's own self-check, :class:`~nexus_vllm.integration.scheduler.live_blocks.PoolPeaks`,
runs in the scheduler when ``NEXUS_VLLM_SELF_CHECK`` is set, and is read here too).
Targets vLLM 0.32-0.34's ``KVCacheManager`` (``coordinator.single_type_managers``,
``req_to_blocks``, ``block_pool``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestPeak:
    """One request as the pool saw it: its largest count of blocks and its bound."""

    prompt: int
    answer: int
    arrival: float
    xargs: dict[str, Any]
    peak: int = 0
    bound: int = -1  # -1: no eviction, so no bound
    plugin_peak: int = 0  # the live-block index's own high-water mark


@dataclass
class PoolWatch:
    """vLLM's block lists of ``scheduler`` (a Nexus scheduler), read by :meth:`read`.

    :meth:`wrap` reads them after every ``scheduler.schedule()``, the one place vLLM
    allocates a step's blocks (eviction only frees), so the largest count read is the most
    a request ever held.

    Attributes
    ----------
    rows : dict of str to RequestPeak
        Every request seen, finished ones included.
    mismatches : list of (int, int)
        Reads where the pool's used blocks differed from the sum of the requests' blocks
        (``(used, sum)``; with prefix caching off every used block is a request's).
    check_peaks : dict of str to int
        The plugin's self-check (``AdmissionGate.check_pool``) per request, when ``check``.
    """

    scheduler: Any
    check: bool = False
    rows: dict[str, RequestPeak] = field(default_factory=dict)
    mismatches: list[tuple[int, int]] = field(default_factory=list)
    check_peaks: dict[str, int] = field(default_factory=dict)
    reads: int = 0

    def __post_init__(self) -> None:
        kvm = self.scheduler.kv_cache_manager
        self.managers = tuple(kvm.coordinator.single_type_managers)
        self.pool = kvm.block_pool

    def wrap(self) -> PoolWatch:
        """Read after every ``schedule()`` of the scheduler (patches the instance)."""
        original = self.scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            self.read()
            return out

        self.scheduler.schedule = schedule
        return self

    def held(self, req_id: str) -> int:
        """Blocks ``req_id`` holds in every group now (null entries are not blocks)."""
        return sum(1 for m in self.managers for b in m.req_to_blocks.get(req_id, ())
                   if not b.is_null)

    def read(self) -> None:
        self.reads += 1
        mgr = self.scheduler.nexus_manager
        total = 0
        for req_id in {r for m in self.managers for r in m.req_to_blocks}:
            held = self.held(req_id)
            total += held
            request = self.scheduler.requests.get(req_id)
            if request is None:
                continue
            row = self.rows.get(req_id)
            if row is None:
                row = self.rows[req_id] = RequestPeak(
                    prompt=int(request.num_prompt_tokens), answer=int(request.max_tokens),
                    arrival=float(request.arrival_time),
                    xargs=dict(request.sampling_params.extra_args or {}))
            # What admission reserved (a resumed request's covers its recompute).
            bound = mgr.bound_blocks(request)
            if bound is not None:
                row.bound = max(row.bound, int(bound))
            row.peak = max(row.peak, held)
            state = mgr.states.get(req_id)
            if state is not None:
                row.plugin_peak = max(row.plugin_peak, int(state.peak_live_blocks))
        used = int(self.pool.num_gpu_blocks) - 1 - int(self.pool.get_num_free_blocks())
        if used != total:
            self.mismatches.append((used, total))
        if self.check:
            gate = mgr.admission
            gate.check_pool(self.scheduler.requests)  # what NexusScheduler.schedule calls
            for req_id, (peak, _) in gate.pool.peaks.items():
                self.check_peaks[req_id] = max(self.check_peaks.get(req_id, 0), peak)

    def over_bound(self) -> list[RequestPeak]:
        """Requests whose peak went above their bound."""
        return [r for r in self.rows.values() if r.peak > r.bound >= 0]
