"""Scheduler-side eviction: when to score, which blocks to drop, freeing them.

:class:`EvictionManager` is what ``NexusScheduler`` calls (``plan_step`` after vLLM's
``schedule()``, ``apply_reply`` before its ``update_from_output()``, ``stats`` from
``make_stats()``) and what the wraps on vLLM's ``KVCacheManager`` consult. It coordinates
one part per job:

* :class:`~nexus_vllm.integration.scheduler.request_state.RequestStates`: the one map of
  per-request state, a
  :class:`~nexus_vllm.integration.scheduler.request_state.RequestEvictionState` each
  (config, trigger, policy state and what every part below keeps for the request; the
  budget trigger of one step is its ``plan_event``). The parts keep nothing per request
  themselves, so a request's end is one ``finish`` and a restart one ``restart``;
* :class:`~nexus_vllm.integration.scheduler.live_blocks.LiveBlocks`: the requests' block
  lists, nulled and freed in place (the list stays logical), and each request's live
  blocks, kept as they change rather than read from the list every step;
* :class:`~nexus_vllm.integration.scheduler.admission.AdmissionGate`: reserves each evicting
  request's bound before it starts (wraps ``allocate_slots``);
* :mod:`~nexus_vllm.integration.scheduler.prefix_cache`: what an evicting request may
  publish to the prefix cache (its clean watermark, wraps ``cache_blocks``) and the hit it
  may start from (wraps ``get_computed_blocks``);
* :class:`~nexus_vllm.integration.scheduler.plan_channel.PlanChannel`: step ids, nulls resent
  until the worker acknowledges them;
* :class:`~nexus_vllm.integration.scheduler.evictor.Evictor`: the worker's scores turned into
  evictions (policy, null + free).

The scheduler builds it from :class:`SchedulerParts` (the evictor, and the
:class:`PlanSender` that puts each plan on vLLM's output): the real parts, or a test
double of one where ``NEXUS_VLLM_FAULTS`` names a scheduler fault
(``faults.with_doubles``, ``integration/testing/scheduler_doubles.py``).

Every budget rule (a request's target and hard limit at each step, its admission bound,
the blocks its policy must keep, all following its ``prompt_mode``) comes from
:class:`nexus_vllm.core.EvictionConfig`, and when events fire from
:class:`nexus_vllm.core.EvictionTrigger`: the rules the transformers path runs too.

Steps in flight: vLLM may schedule up to ``k`` steps (``max_concurrent_batches``: the
pipeline stages, one more with async scheduling) before it hands the first one's output
to ``apply_reply``. A request whose event is planned is held out of vLLM's schedule until
that event's reply is applied (``vllm_compat.hold_request``, vLLM's own "not before this
step" field), so its next step sees the event's nulls, as with one step in flight: the
same events, the same evictions and the same bounds for every ``k``. Other requests keep
the pipeline busy meanwhile. Only the sliding-window groups' allowance counts ``k``
(vLLM frees their blocks once a step is processed: ``WindowBlocks``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from nexus_vllm.core import EvictionConfig, cdiv
from nexus_vllm.integration import faults
from nexus_vllm.integration.compat.vllm_compat import (
    BlockPoolView,
    cap_prefix_caching,
    cap_prefix_hits,
    gate_admission,
    hold_request,
    kv_cache_groups,
    preemption_count,
    release_request,
    reset_request_ids,
)
from nexus_vllm.integration.compat.vllm_types import EngineRequest, StepSchedule
from nexus_vllm.integration.metrics import NexusStats, SchedulerCounters
from nexus_vllm.integration.protocol import ScoreRequest, StepPlan, WorkerReply, attach_plan
from nexus_vllm.integration.scheduler.admission import AdmissionGate
from nexus_vllm.integration.scheduler.evictor import Evictor
from nexus_vllm.integration.scheduler.live_blocks import LiveBlocks, WindowBlocks
from nexus_vllm.integration.scheduler.plan_channel import PlanChannel
from nexus_vllm.integration.scheduler.prefix_cache import prefix_hit_cap
from nexus_vllm.integration.scheduler.request_state import (
    InFlightEvent,
    RequestEvictionState,
    RequestStates,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

logger = init_logger(__name__)

__all__ = ["EvictionManager", "PlanSender", "SchedulerParts"]


class PlanSender:
    """Puts each step's plan on vLLM's ``SchedulerOutput``, which carries it to the
    workers."""

    def send(self, scheduler_output: object, plan: StepPlan) -> None:
        attach_plan(scheduler_output, plan, step_id=plan.step_id)


@dataclass(frozen=True)
class SchedulerParts:
    """The parts a scheduler is built from (factories: each scheduler gets its own)."""

    evictor: Callable[..., Evictor] = Evictor
    sender: Callable[[], PlanSender] = PlanSender


class EvictionManager:
    """Plans scoring, applies policy decisions, frees blocks, counts metrics.

    Parameters
    ----------
    server_cfg : EvictionConfig
        The server's config; requests may override method and budget.
    kv_cache_manager : vllm.v1.core.kv_cache_manager.KVCacheManager
        Its ``cache_blocks``, ``get_computed_blocks`` and ``allocate_slots`` are wrapped
        on the instance (``vllm_compat``).
    block_size : int
    max_model_len : int, optional
        Bounds each request's longest sequence at admission.
    steps_in_flight : int
        k, the steps vLLM schedules before the first reply comes back. The full-attention
        group's bounds do not depend on it (see the module docstring); a sliding-window
        group holds the tokens of the k steps in flight beyond its window.
    step_tokens : int, optional
        Most tokens one request computes in a step (vLLM's token budget per step): a
        prompt step in flight in a sliding-window group (at most ``chunk_size`` where
        ``server_cfg`` evicts mid-prompt: ``WindowBlocks``). Needed only for models with
        sliding-window groups.
    evictor : callable, optional
        Builds the :class:`Evictor` (keyword arguments as its own).
    """

    def __init__(self, server_cfg: EvictionConfig, kv_cache_manager: KVCacheManager,
                 block_size: int,
                 max_model_len: int | None = None, steps_in_flight: int = 1,
                 step_tokens: int | None = None,
                 evictor: Callable[..., Evictor] = Evictor) -> None:
        self.server_cfg = server_cfg
        self.block_size = int(block_size)
        self.steps_in_flight = int(steps_in_flight)
        self.counters = SchedulerCounters()
        # Counted into the stats' fault counter (reported and cleared each stats update).
        self.fault = faults.FaultLog(logger, self.counters.faults)
        self.pool = BlockPoolView(kv_cache_manager)
        # Full attention is evicted; sliding-window groups stay vLLM's (counted only).
        groups = kv_cache_groups(kv_cache_manager)
        if int(groups.evicted.block_size) != self.block_size:
            raise ValueError(f"nexus-vllm: the full-attention group's blocks hold "
                             f"{groups.evicted.block_size} tokens, the scheduler's "
                             f"{self.block_size}")
        self.blocks = LiveBlocks(groups.evicted, self.pool, self.block_size)
        if groups.windows and step_tokens is None:
            raise ValueError("a model with sliding-window groups needs step_tokens")
        self.windows = WindowBlocks(groups.windows, int(step_tokens or 0),
                                    self.steps_in_flight, server_cfg=server_cfg)
        self.states = RequestStates(server_cfg)
        self.channel = PlanChannel(self.states, self.fault)
        self.admission = AdmissionGate(self.states, self.blocks, self.counters,
                                       max_model_len, windows=self.windows)
        self.evictor = evictor(states=self.states, blocks=self.blocks, channel=self.channel,
                               counters=self.counters, fault=self.fault)
        for manager in groups.managers:
            cap_prefix_caching(manager, self.caching_limit)
        cap_prefix_hits(kv_cache_manager, self.hit_cap, windows=bool(groups.windows))
        gate_admission(kv_cache_manager, self.may_admit)

    # -- vLLM's KVCacheManager (through the wraps) -------------------------------------
    def caching_limit(self, request: EngineRequest) -> int | None:
        """Tokens of an evicting request the prefix cache may publish: its clean
        watermark (None: no cap, it has not evicted or does not evict)."""
        st = self.states.get(request.request_id)
        return None if st is None else st.clean_watermark

    def hit_cap(self, request: EngineRequest) -> tuple[int, int] | None:
        """``(limit, multiple)`` for an evicting request's prefix hit (None: no cap;
        :func:`~nexus_vllm.integration.scheduler.prefix_cache.prefix_hit_cap`)."""
        st = self.states.resolve(request)
        if st is None:
            return None
        return prefix_hit_cap(st.cfg, st.prompt_tokens, self.block_size)

    def bound_blocks(self, request: EngineRequest) -> int | None:
        """Most blocks an evicting request ever holds (None: it does not evict)."""
        return self.admission.bound_blocks(request)

    def may_admit(self, request: EngineRequest) -> bool:
        """Whether the pool can take the request now (:meth:`AdmissionGate.may_admit`)."""
        return self.admission.may_admit(request)

    # -- request lifecycle ---------------------------------------------------------------
    def record_finished(self, req_ids: Iterable[str]) -> None:
        """Count the peak live blocks of finished requests (once each: from the stats of
        the step they finish in, else when the next plan retires them)."""
        for prompt_mode, peak in self.states.take_peaks(req_ids):
            self.counters.add_request_peak(prompt_mode, peak)

    # -- schedule() --------------------------------------------------------------------
    def plan_step(self, scheduler_output: StepSchedule,
                  requests: Mapping[str, EngineRequest]) -> StepPlan:
        """Build the plan for the step just scheduled (``num_computed_tokens`` already
        counts this step's tokens)."""
        self.record_finished(scheduler_output.finished_req_ids)
        for req_id in scheduler_output.finished_req_ids:
            self.states.finish(req_id)
        # A fresh block list: old nulls no longer apply; same seed -> same evictions. An
        # event still in flight was planned on the old list: its reply will be dropped
        # (ScoreRequest.epoch), and the request is no longer held for it.
        for req_id in reset_request_ids(scheduler_output):
            st = self.states.get(req_id)
            request = requests.get(req_id)
            if st is not None and st.event_in_flight is not None and request is not None:
                release_request(request, st.event_in_flight.resume_step)
            self.states.restart(req_id)
        step_id, evict = self.channel.open_step()
        score: dict[str, ScoreRequest] = {}
        track: list[str] = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None:
                continue
            st = self.states.resolve(request)
            if st is None:
                continue
            track.append(req_id)
            sreq = self._plan_event(st, request, int(n))
            if sreq is not None:
                score[req_id] = sreq
                # Not scheduled again before this event's reply is applied.
                st.event_in_flight = InFlightEvent(step_id, hold_request(request))
                self.counters.event_holds += 1
        return StepPlan(step_id=step_id, evict=evict, score=score, track=tuple(track),
                        sink_blocks=int(self.server_cfg.sink_blocks))

    def _plan_event(self, st: RequestEvictionState, request: EngineRequest,
                    n: int) -> ScoreRequest | None:
        tokens_after = int(request.num_computed_tokens)
        live = self.blocks.live_indices(st, cdiv(tokens_after, self.block_size))
        self.counters.over_budget_peak = max(self.counters.over_budget_peak,
                                             len(live) - st.hard_limit(tokens_after, n))
        self.counters.live_blocks_peak = max(self.counters.live_blocks_peak, len(live))
        in_flight = st.event_in_flight is not None
        if in_flight:
            # vLLM scheduled a held request: its event waits for the one in flight.
            self.fault("event_in_flight", "a request was scheduled while its eviction "
                        "event was in flight; its next event waits for that reply")
        return st.plan_event(tokens_after, n, live, self.block_size,
                             epoch=preemption_count(request), may_fire=not in_flight)

    # -- update_from_output() ----------------------------------------------------------
    def apply_reply(self, plan: StepPlan | None, reply: WorkerReply | None,
                    requests: Mapping[str, EngineRequest]) -> None:
        """Acknowledge the plan the worker applied; run each scored request's policy and
        evict (null + free) the dropped blocks.

        A failure skips the rest of the step's events and is counted as the fault
        ``reply_error``: nothing is freed before a decision is complete, so the worker's
        view stays consistent.
        """
        try:
            self._apply_reply(plan, reply, requests)
        except Exception:
            self.fault("reply_error", "applying the worker's reply failed; skipping the "
                        "rest of this step's eviction events", exc=True)

    def _apply_reply(self, plan: StepPlan | None, reply: WorkerReply | None,
                     requests: Mapping[str, EngineRequest]) -> None:
        if plan is None:
            return
        try:
            if not self.channel.acknowledge(plan, reply):
                if reply is not None:
                    self.counters.add_faults(reply.faults)
                return
            assert reply is not None  # acknowledged
            self.counters.add_faults(reply.faults)
            self.counters.scoring_us += int(reply.scoring_seconds * 1e6)
            self.evictor.apply(plan, reply, requests)
        finally:
            # The plan's events are over, applied or dropped: their requests run again.
            self._release(plan, requests)

    def _release(self, plan: StepPlan, requests: Mapping[str, EngineRequest]) -> None:
        for req_id in plan.score:
            st = self.states.get(req_id)
            event = None if st is None else st.event_in_flight
            if event is None or event.step_id != plan.step_id:
                continue  # finished, or restarted since (a newer event may be in flight)
            assert st is not None
            st.event_in_flight = None
            request = requests.get(req_id)
            if request is not None:
                release_request(request, event.resume_step)

    # -- make_stats() ------------------------------------------------------------------
    def stats(self, requests: Mapping[str, EngineRequest]) -> NexusStats:
        """This engine's stats update: counters since the last one, gauges sampled now."""
        live = [self.blocks.live_count(st) for r, st in self.states.items() if r in requests]
        self.counters.set_gauges(
            live_blocks=sum(live),
            live_blocks_max=max(live, default=0),
            free_blocks=self.pool.num_free(),
            total_blocks=self.pool.num_usable(),
            plans_in_flight=self.channel.outstanding(),
        )
        return self.counters.drain()
