"""Eviction metrics: collected in the engine core, exported on the API server's /metrics.

The scheduler (engine-core process) counts evictions and samples block usage each step;
the numbers ride to the API server inside ``SchedulerStats.num_kv_fetch_reqs_by_stage``
(a ``dict[str, int]`` that vLLM serialises as is and reads by fixed keys only) under keys
prefixed ``nexus:``. The ``stat_logger`` patch pops them there, before vLLM's loggers see
the dict, and feeds the Prometheus series below (same registry as ``vllm:*``):

========================================  =======  ============================================
series                                    type     meaning
========================================  =======  ============================================
``vllm:nexus_evicted_blocks_total``       counter  KV blocks evicted and returned to the pool
``vllm:nexus_eviction_events_total``      counter  eviction events (one request, one step)
``vllm:nexus_scoring_seconds_total``      counter  worker time spent scoring blocks
``vllm:nexus_live_blocks``                gauge    live KV blocks of all evicting requests
``vllm:nexus_live_blocks_max``            gauge    live blocks of the largest evicting request
``vllm:nexus_live_blocks_peak``           gauge    ``live_blocks_max`` high-water mark
``vllm:nexus_live_blocks_over_budget``    gauge    high-water mark of live blocks minus
                                                   the request's hard limit (its target under
                                                   its prompt_mode + one chunk,
                                                   ``EvictionConfig.hard_limit``); <= 0 when
                                                   the budget always held
``vllm:nexus_free_blocks``                gauge    free blocks in vLLM's block pool
``vllm:nexus_total_blocks``               gauge    usable blocks in vLLM's block pool
``vllm:nexus_policy_seconds_total``       counter  scheduler time planning events and running
                                                   policies (plan + decisions + freeing)
``vllm:nexus_step_seconds_total``         counter  engine step time (schedule to update) of an
                                                   evicting server: the denominator of the
                                                   eviction overhead
``vllm:nexus_admission_waits_total``      counter  times an evicting request waited for blocks
                                                   at admission (its bound did not fit yet)
``vllm:nexus_event_holds_total``          counter  eviction events whose request was held out
                                                   of vLLM's schedule until the reply came
                                                   back (every event; with k steps in flight
                                                   each costs that request up to k - 1 steps)
``vllm:nexus_plans_in_flight``            gauge    plans sent whose reply was not processed
                                                   yet when stats were taken (up to k - 1:
                                                   pipeline stages, async scheduling)
``vllm:nexus_faults_total{kind}``         counter  faults absorbed without harm, by kind (a
                                                   lost or stale plan, a scoring or policy
                                                   error, ...); each kind is logged once
``vllm:nexus_request_peak_live_blocks``   histo-   each finished evicting request's peak live
``{prompt_mode}``                         gram     blocks (the memory it held at most, before
                                                   any event freed blocks), by ``prompt_mode``;
                                                   ``_sum / _count`` is the mean peak
========================================  =======  ============================================

A finished request's peak rides as ``nexus:peak:<prompt_mode>:<blocks>`` -> how many
requests finished with that peak since the last stats update (a few keys per update).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["PREFIX", "SchedulerCounters", "export"]

PREFIX = "nexus:"
FAULT_PREFIX = "fault:"
PEAK_PREFIX = "peak:"
# Buckets of the peak histogram, in blocks: powers of two and the halves between them.
PEAK_BUCKETS = tuple(sorted({b for k in range(18) for b in (2 ** k, 3 * 2 ** k // 2)
                             if b > 0})) + (float("inf"),)
_COUNTERS = {
    "evicted_blocks": ("vllm:nexus_evicted_blocks", "KV blocks evicted and freed.", 1.0),
    "eviction_events": ("vllm:nexus_eviction_events", "Eviction events.", 1.0),
    "scoring_us": ("vllm:nexus_scoring_seconds", "Time spent scoring KV blocks.", 1e-6),
    "policy_us": ("vllm:nexus_policy_seconds",
                  "Scheduler time planning eviction events and running policies.", 1e-6),
    "step_us": ("vllm:nexus_step_seconds", "Engine step time of an evicting server.", 1e-6),
    "admission_waits": ("vllm:nexus_admission_waits",
                        "Evicting requests held back at admission until their bound fits.",
                        1.0),
    "event_holds": ("vllm:nexus_event_holds",
                    "Eviction events whose request waited for the reply before its next "
                    "step.", 1.0),
}
_GAUGES = {
    "live_blocks": ("vllm:nexus_live_blocks", "Live KV blocks of evicting requests."),
    "live_blocks_max": ("vllm:nexus_live_blocks_max", "Live blocks of the largest request."),
    "live_blocks_peak": ("vllm:nexus_live_blocks_peak", "High-water mark of live_blocks_max."),
    "over_budget_peak": ("vllm:nexus_live_blocks_over_budget",
                         "High-water mark of live blocks minus (budget + one chunk)."),
    "free_blocks": ("vllm:nexus_free_blocks", "Free blocks in the KV block pool."),
    "total_blocks": ("vllm:nexus_total_blocks", "Usable blocks in the KV block pool."),
    "plans_in_flight": ("vllm:nexus_plans_in_flight",
                        "Eviction plans sent whose reply was not processed yet."),
}
# Large negative start so any real value replaces it.
_NO_VALUE = -(1 << 40)


@dataclass
class SchedulerCounters:
    """Engine-core side accumulators; ``drain()`` returns the ``nexus:`` stats dict."""

    evicted_blocks: int = 0
    eviction_events: int = 0
    scoring_us: int = 0
    policy_us: int = 0
    step_us: int = 0
    admission_waits: int = 0
    event_holds: int = 0
    live_blocks_peak: int = 0
    over_budget_peak: int = _NO_VALUE
    faults: Counter[str] = field(default_factory=Counter)
    # (prompt_mode, peak live blocks) -> finished requests, since the last drain.
    request_peaks: Counter[tuple[str, int]] = field(default_factory=Counter)
    _gauges: dict[str, int] = field(default_factory=dict)

    def set_gauges(self, **values: int) -> None:
        self._gauges.update(values)

    def add_request_peak(self, prompt_mode: str, peak_blocks: int) -> None:
        """A finished request's peak live blocks."""
        self.request_peaks[(str(prompt_mode), int(peak_blocks))] += 1

    def add_faults(self, counts: dict[str, int]) -> None:
        self.faults.update(counts)

    def drain(self) -> dict[str, int]:
        out = {
            PREFIX + "evicted_blocks": self.evicted_blocks,
            PREFIX + "eviction_events": self.eviction_events,
            PREFIX + "scoring_us": self.scoring_us,
            PREFIX + "admission_waits": self.admission_waits,
            PREFIX + "event_holds": self.event_holds,
            PREFIX + "policy_us": self.policy_us,
            PREFIX + "step_us": self.step_us,
            PREFIX + "live_blocks_peak": self.live_blocks_peak,
        }
        if self.over_budget_peak != _NO_VALUE:
            out[PREFIX + "over_budget_peak"] = self.over_budget_peak
        out.update({PREFIX + k: int(v) for k, v in self._gauges.items()})
        out.update({PREFIX + FAULT_PREFIX + k: int(v) for k, v in self.faults.items() if v})
        out.update({f"{PREFIX}{PEAK_PREFIX}{mode}:{peak}": int(n)
                    for (mode, peak), n in self.request_peaks.items() if n})
        self.evicted_blocks = self.eviction_events = self.scoring_us = 0
        self.admission_waits = self.policy_us = self.step_us = self.event_holds = 0
        self.faults.clear()
        self.request_peaks.clear()
        return out


class _PromMetrics:
    """Prometheus series in the API server (created lazily: vLLM's PrometheusStatLogger
    unregisters every ``vllm:`` collector when it starts)."""

    def __init__(self) -> None:
        from prometheus_client import Counter as PromCounter
        from prometheus_client import Gauge, Histogram

        self.counters = {k: (PromCounter(n, d, ["engine"]), scale)
                         for k, (n, d, scale) in _COUNTERS.items()}
        self.gauges = {k: Gauge(n, d, ["engine"], multiprocess_mode="mostrecent")
                       for k, (n, d) in _GAUGES.items()}
        self.faults = PromCounter("vllm:nexus_faults", "Eviction faults absorbed, by kind.",
                              ["engine", "kind"])
        self.peaks = Histogram("vllm:nexus_request_peak_live_blocks",
                               "Peak live KV blocks of each finished evicting request.",
                               ["engine", "prompt_mode"], buckets=PEAK_BUCKETS)

    def observe(self, stats: dict[str, int], engine_idx: int) -> None:
        label = str(engine_idx)
        for key, value in stats.items():
            if key.startswith(FAULT_PREFIX):
                if value > 0:
                    self.faults.labels(label, key[len(FAULT_PREFIX):]).inc(value)
            elif key.startswith(PEAK_PREFIX):
                mode, _, blocks = key[len(PEAK_PREFIX):].rpartition(":")
                if mode and blocks.isdigit():
                    hist = self.peaks.labels(label, mode)
                    for _ in range(value):
                        hist.observe(int(blocks))
            elif key in self.counters:
                counter, scale = self.counters[key]
                if value > 0:
                    counter.labels(label).inc(value * scale)
            elif key in self.gauges:
                self.gauges[key].labels(label).set(value)


_PROM: _PromMetrics | None = None
_LOCK = threading.Lock()


def pop_nexus_stats(stage_counts: dict[str, int]) -> dict[str, int]:
    """Remove and return the ``nexus:`` entries of ``num_kv_fetch_reqs_by_stage``."""
    keys = [k for k in stage_counts if isinstance(k, str) and k.startswith(PREFIX)]
    return {k[len(PREFIX):]: int(stage_counts.pop(k)) for k in keys}


def export(stats: dict[str, int], engine_idx: int = 0) -> None:
    """Feed one step's stats into the Prometheus series."""
    global _PROM
    if not stats:
        return
    with _LOCK:
        if _PROM is None:
            _PROM = _PromMetrics()
        _PROM.observe(stats, engine_idx)
