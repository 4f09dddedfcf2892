"""Eviction metrics: collected in the engine core, exported on the API server's /metrics.

The scheduler (engine-core process) counts evictions and samples block usage each step;
each stats update becomes one :class:`NexusStats`, which rides to the API server in
``SchedulerStats.kv_connector_stats`` under the key :data:`STATS_KEY` (:func:`attach_stats`)
and is taken out there (:func:`take_stats`) before vLLM's loggers run, by the
``stat_logger`` patch, which feeds the Prometheus series below (same registry as
``vllm:*``).

Why that field: it is the one ``SchedulerStats`` field vLLM carries as an opaque payload
(``dict[str, Any]``) and never interprets itself; it belongs to a KV connector, and
eviction refuses KV connectors (``frontend/engine_policy.py``), so on an evicting server
it is always empty. Where a connector's stats do hold it, ours ride beside them under
their own key, in a copy of the connector's dict, and taking ours out leaves the
connector's as vLLM made them. No field of our own survives the trip: vLLM sends ``SchedulerStats``
with msgspec and decodes it into vLLM's own dataclass (``vllm/v1/serial_utils.py``,
``MsgpackDecoder(EngineCoreOutputs)`` in ``vllm/v1/engine/core_client.py``), which drops
attributes and subclass fields it does not declare. The payload is taken out before
vLLM's loggers see it because, without a connector, vLLM's ``LoggingStatLogger`` cannot
read that field (``KVConnectorLogging.observe`` needs the connector's class); the
scheduler ships it only where that patch is installed (:func:`route_open`).

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
                                                   ``budget.hard_limit``); <= 0 when
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
``vllm:nexus_pool_blocks_peak``           gauge    self-check only (``NEXUS_VLLM_SELF_CHECK=1``):
                                                   most blocks one evicting request held in
                                                   vLLM's own block lists
``vllm:nexus_pool_over_bound``            gauge    self-check only: most blocks one request
                                                   held in vLLM's lists above its admission
                                                   bound; <= 0 when every bound held
========================================  =======  ============================================

Each series carries vLLM's ``engine`` label (the data-parallel engine index vLLM passes
with the stats), so every engine core of a data-parallel server reports its own.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.metrics.stats import SchedulerStats

__all__ = ["STATS_KEY", "TAKES_STATS", "NexusStats", "SchedulerCounters", "attach_stats",
           "export", "route_open", "take_stats"]

# The key of our payload in SchedulerStats.kv_connector_stats.
STATS_KEY = "nexus_vllm"
# Set (True) on the StatLoggerManager.record wrap that takes the payload out before
# vLLM's loggers run (frontend/patches/stat_logger.py).
TAKES_STATS = "_nexus_takes_stats"
# Buckets of the peak histogram, in blocks: powers of two and the halves between them.
PEAK_BUCKETS = tuple(sorted({b for k in range(18) for b in (2 ** k, 3 * 2 ** k // 2)
                             if b > 0})) + (float("inf"),)
# Counter -> (series, help, scale to the series' unit); the counters SchedulerCounters keeps.
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
    "pool_blocks_peak": ("vllm:nexus_pool_blocks_peak",
                         "Self-check: most blocks one evicting request held in vLLM's pool."),
    "pool_over_bound": ("vllm:nexus_pool_over_bound",
                        "Self-check: most blocks one request held in vLLM's pool above its "
                        "admission bound (<= 0: every bound held)."),
}
# Large negative start so any real value replaces it.
_NO_VALUE = -(1 << 40)


@dataclass(frozen=True)
class NexusStats:
    """One stats update of one engine core.

    Attributes
    ----------
    counters : mapping of str to int
        Increments since the previous update, in the counter's raw unit (``*_us``:
        microseconds).
    gauges : mapping of str to int
        Values as sampled now (a high-water mark only once it has a value).
    faults : mapping of str to int
        Faults absorbed since the previous update, by kind.
    peaks : mapping of (prompt_mode, peak live blocks) to int
        Evicting requests finished since the previous update.
    """

    counters: Mapping[str, int] = field(default_factory=dict)
    gauges: Mapping[str, int] = field(default_factory=dict)
    faults: Mapping[str, int] = field(default_factory=dict)
    peaks: Mapping[tuple[str, int], int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The wire form: plain dicts and lists, which vLLM's msgspec encoder sends as is."""
        return {"counters": dict(self.counters), "gauges": dict(self.gauges),
                "faults": dict(self.faults),
                "peaks": [[mode, blocks, n] for (mode, blocks), n in self.peaks.items()]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NexusStats:
        """Inverse of :meth:`to_dict`."""
        def ints(name: str) -> dict[str, int]:
            return {str(k): int(v) for k, v in data.get(name, {}).items()}

        return cls(counters=ints("counters"), gauges=ints("gauges"), faults=ints("faults"),
                   peaks={(str(mode), int(blocks)): int(n)
                          for mode, blocks, n in data.get("peaks", ())})


@dataclass
class SchedulerCounters:
    """Engine-core side accumulators; ``drain()`` returns the stats update."""

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

    def drain(self) -> NexusStats:
        """The update since the last drain; the counters start again from zero."""
        gauges = {"live_blocks_peak": self.live_blocks_peak}
        if self.over_budget_peak != _NO_VALUE:
            gauges["over_budget_peak"] = self.over_budget_peak
        gauges.update((k, int(v)) for k, v in self._gauges.items())
        out = NexusStats(
            counters={k: int(getattr(self, k)) for k in _COUNTERS}, gauges=gauges,
            faults={k: int(v) for k, v in self.faults.items() if v},
            peaks={key: int(n) for key, n in self.request_peaks.items() if n})
        for k in _COUNTERS:
            setattr(self, k, 0)
        self.faults.clear()
        self.request_peaks.clear()
        return out


# -- the route: engine core -> API server ----------------------------------------------
def route_open() -> bool:
    """Whether the API server takes the payload out before vLLM's loggers: the wrap that
    does is installed in this process (patches are all or nothing, the same in every
    process of a server)."""
    from vllm.v1.metrics.loggers import StatLoggerManager

    return bool(getattr(StatLoggerManager.record, TAKES_STATS, False))


def attach_stats(scheduler_stats: SchedulerStats, stats: NexusStats) -> bool:
    """Engine core: put ``stats`` on vLLM's stats of this step, beside a KV connector's
    stats if they hold the field (in a new dict: ``KVConnectorStats.to_dict`` hands out
    the connector's own). False (nothing attached) where the field holds something
    :func:`take_stats` could not give back exactly: an empty dict (which it would turn
    into None), one that already has :data:`STATS_KEY`, or not a dict."""
    data = scheduler_stats.kv_connector_stats
    if data is None:
        scheduler_stats.kv_connector_stats = {STATS_KEY: stats.to_dict()}
        return True
    if not isinstance(data, dict) or not data or STATS_KEY in data:
        return False
    scheduler_stats.kv_connector_stats = {**data, STATS_KEY: stats.to_dict()}
    return True


def take_stats(scheduler_stats: SchedulerStats) -> NexusStats | None:
    """API server: remove the payload :func:`attach_stats` put on vLLM's stats (None:
    there is none), leaving the field as vLLM's loggers expect it: None, or the KV
    connector's stats that were there."""
    data = scheduler_stats.kv_connector_stats
    if not isinstance(data, dict) or STATS_KEY not in data:
        return None
    payload = data.pop(STATS_KEY)
    if not data:
        scheduler_stats.kv_connector_stats = None
    return NexusStats.from_dict(payload)


# -- the API server's Prometheus series ------------------------------------------------
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

    def observe(self, stats: NexusStats, engine_idx: int) -> None:
        label = str(engine_idx)
        for key, value in stats.counters.items():
            if key in self.counters and value > 0:
                counter, scale = self.counters[key]
                counter.labels(label).inc(value * scale)
        for key, value in stats.gauges.items():
            if key in self.gauges:
                self.gauges[key].labels(label).set(value)
        for kind, n in stats.faults.items():
            if n > 0:
                self.faults.labels(label, kind).inc(n)
        for (mode, blocks), n in stats.peaks.items():
            hist = self.peaks.labels(label, mode)
            for _ in range(n):
                hist.observe(blocks)


_PROM: _PromMetrics | None = None
_LOCK = threading.Lock()


def export(stats: NexusStats, engine_idx: int = 0) -> None:
    """Feed one stats update of engine ``engine_idx`` into the Prometheus series."""
    global _PROM
    with _LOCK:
        if _PROM is None:
            _PROM = _PromMetrics()
        _PROM.observe(stats, engine_idx)
