"""Patch: export the scheduler's eviction stats on vLLM's ``/metrics``.

Why
    The scheduler runs in the engine-core process, ``/metrics`` is served by the API
    server; ``SchedulerStats`` is the only per-step channel between them and it has no
    free-form field for plugins.
How
    The scheduler puts ``nexus:*`` integer entries into
    ``SchedulerStats.num_kv_fetch_reqs_by_stage`` (serialised as a plain ``dict[str,
    int]``; vLLM reads it by fixed stage names only). This wrapper of
    ``StatLoggerManager.record`` pops those entries before vLLM's loggers run (so the
    "KV fetch" log line stays untouched) and updates the ``vllm:nexus_*`` series.
vLLM version
    0.32 to 0.34 (``vllm/v1/metrics/loggers.py``, ``vllm/v1/metrics/stats.py``).
Plan
    Move to ``KVConnectorStats``/``KVConnectorPromMetrics`` if the plugin grows a KV
    connector, or to a stat-logger plugin if ``SchedulerStats`` gains an extras field.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from nexus_vllm.integration.compat.catalogue import swap
from nexus_vllm.integration.metrics import export, pop_nexus_stats

if TYPE_CHECKING:
    from vllm.v1.metrics.loggers import StatLoggerManager
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

__all__ = ["apply"]


def apply() -> None:
    from vllm.v1.metrics.loggers import StatLoggerManager

    orig = StatLoggerManager.record
    if getattr(orig, "_nexus_patched", False):
        return

    @functools.wraps(orig)
    def record(self: StatLoggerManager, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None, *args: Any,
               **kwargs: Any) -> None:
        if scheduler_stats is not None:
            counts = getattr(scheduler_stats, "num_kv_fetch_reqs_by_stage", None)
            if counts:
                stats = pop_nexus_stats(counts)
                if stats:
                    # (mm_cache_stats, engine_idx) when passed by position.
                    engine_idx = kwargs.get("engine_idx", args[1] if len(args) >= 2 else None)
                    export(stats, engine_idx if isinstance(engine_idx, int) else 0)
        orig(self, scheduler_stats, iteration_stats, *args, **kwargs)

    record._nexus_patched = True  # type: ignore[attr-defined]
    swap(StatLoggerManager, "record", record)
