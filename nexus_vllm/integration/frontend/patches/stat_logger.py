"""Patch: export the scheduler's eviction stats on vLLM's ``/metrics``.

Why
    The scheduler runs in the engine-core process, ``/metrics`` is served by the API
    server; ``SchedulerStats`` is the only per-step channel between them and it has no
    field for plugins. The eviction stats ride in ``SchedulerStats.kv_connector_stats``
    (``integration/metrics.py`` says why that field), which vLLM's ``LoggingStatLogger``
    cannot read without a KV connector.
How
    This wrapper of ``StatLoggerManager.record`` takes the eviction stats out of that
    field (``metrics.take_stats``) before any of vLLM's loggers runs, and updates the
    ``vllm:nexus_*`` series for the engine the stats came from.
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
from nexus_vllm.integration.metrics import TAKES_STATS, export, take_stats

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
        stats = None if scheduler_stats is None else take_stats(scheduler_stats)
        if stats is not None:
            # (mm_cache_stats, engine_idx) when passed by position.
            engine_idx = kwargs.get("engine_idx", args[1] if len(args) >= 2 else None)
            export(stats, engine_idx if isinstance(engine_idx, int) else 0)
        orig(self, scheduler_stats, iteration_stats, *args, **kwargs)

    record._nexus_patched = True  # type: ignore[attr-defined]
    setattr(record, TAKES_STATS, True)  # the scheduler attaches stats only then
    swap(StatLoggerManager, "record", record)
