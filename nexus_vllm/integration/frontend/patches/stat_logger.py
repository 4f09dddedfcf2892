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
from typing import Any

from nexus_vllm.integration.compat.catalogue import swap
from nexus_vllm.integration.metrics import export, pop_nexus_stats

__all__ = ["apply"]


def apply() -> None:
    from vllm.v1.metrics.loggers import StatLoggerManager

    orig = StatLoggerManager.record
    if getattr(orig, "_nexus_patched", False):
        return

    @functools.wraps(orig)
    def record(self: Any, scheduler_stats: Any, iteration_stats: Any, *args: Any,
               **kwargs: Any) -> Any:
        if scheduler_stats is not None:
            counts = getattr(scheduler_stats, "num_kv_fetch_reqs_by_stage", None)
            if counts:
                stats = pop_nexus_stats(counts)
                if stats:
                    engine_idx = kwargs.get("engine_idx")
                    if engine_idx is None and len(args) >= 2:
                        engine_idx = args[1]
                    export(stats, int(engine_idx or 0))
        return orig(self, scheduler_stats, iteration_stats, *args, **kwargs)

    record._nexus_patched = True  # type: ignore[attr-defined]
    swap(StatLoggerManager, "record", record)
