"""Scheduler subclasses selected by ``scheduler_cls`` for evicting configurations.

``schedule()`` attaches the step's :class:`~nexus_vllm.integration.protocol.StepPlan` to
the ``SchedulerOutput`` (and keeps a lone evicting request's prefill in chunks, see
:func:`~nexus_vllm.integration.compat.vllm_compat.lone_request_prefill_cap`);
``update_from_output()`` reads the worker's
:class:`~nexus_vllm.integration.protocol.WorkerReply`, runs each scored request's policy
and frees the evicted blocks *before* vLLM frees finished requests and schedules the next
step; ``make_stats()`` attaches the eviction stats (``integration/metrics.py``).

vLLM may schedule up to ``k`` steps before it processes the first one's output (its batch
queue: ``max_concurrent_batches``, the pipeline stages, one more with async scheduling):
each plan is kept with the output it rides on until vLLM hands that output back, so a
reply is always paired with its own plan. The overrides live in one mixin over vLLM's
two schedulers: :class:`NexusScheduler` (``Scheduler``) and :class:`NexusAsyncScheduler`
(``AsyncScheduler``, for async scheduling, whose output placeholders let it schedule a
decoding request before its last token is back).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from nexus_vllm.core.budget import evicts_mid_prompt
from nexus_vllm.integration import faults
from nexus_vllm.integration.compat.vllm_compat import (
    check_vllm_version,
    lone_request_prefill_cap,
    prefill_chunk_tokens,
    steps_in_flight,
)
from nexus_vllm.integration.config import config_from_additional
from nexus_vllm.integration.metrics import attach_stats, route_open
from nexus_vllm.integration.protocol import StepPlan, read_reply
from nexus_vllm.integration.scheduler.manager import EvictionManager, SchedulerParts

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.outputs import ModelRunnerOutput

    _SchedulerBase = Scheduler
else:
    _SchedulerBase = object

logger = init_logger(__name__)

__all__ = ["NexusAsyncScheduler", "NexusScheduler", "NexusSchedulerMixin"]


@dataclass(frozen=True)
class _PlannedStep:
    """A scheduled step whose output vLLM has not handed back yet."""

    output: object  # the SchedulerOutput (kept: its id() is the key while it lives)
    plan: StepPlan  # the plan made for it (the one sent, unless a fault double sent another)
    started: float  # perf_counter() when schedule() began


class NexusSchedulerMixin(_SchedulerBase):
    """vLLM's scheduler + streaming KV eviction under a per-request budget."""

    # vLLM's arguments are passed on untouched (their list changes between releases).
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_vllm_version()
        super().__init__(*args, **kwargs)
        cfg = config_from_additional(self.vllm_config.additional_config)
        if cfg is None:
            raise ValueError(f"{type(self).__name__} needs additional_config['nexus'] with "
                             "a method other than 'none' (use --kv-eviction)")
        if self.block_size != cfg.block_size:
            cfg = cfg.replace(block_size=int(self.block_size))
        # The chunk a prompt is computed in: ours where the plugin set vLLM's per-request
        # cap (modes that evict mid-prompt), else vLLM's own; every bound counts it.
        chunk = prefill_chunk_tokens(self.scheduler_config)
        if chunk != cfg.chunk_size:
            cfg = cfg.replace(chunk_size=chunk)
        # vLLM lifts the per-request cap for a lone request: only a server that set the
        # cap (it evicts mid-prompt) needs it kept then (0: nothing to keep).
        self._nexus_lone_cap = chunk if evicts_mid_prompt(cfg) else 0
        k = steps_in_flight(self.vllm_config)
        parts = faults.with_doubles(SchedulerParts())
        # Sliding-window groups hold their window plus the tokens of k steps in flight.
        self.nexus_manager = EvictionManager(
            cfg, self.kv_cache_manager, self.block_size, max_model_len=self.max_model_len,
            steps_in_flight=k,
            step_tokens=int(self.scheduler_config.max_num_batched_tokens),
            evictor=parts.evictor)
        self._nexus_sender = parts.sender()
        self._nexus_stats_route = route_open()
        if not self._nexus_stats_route:
            # Not taken out by that patch, the payload would break vLLM's stat logger.
            logger.warning("nexus-vllm: the plugin's StatLoggerManager.record patch that "
                           "reads the eviction stats is not installed; the vllm:nexus_* "
                           "metrics are not reported")
        # Steps scheduled and not yet handed back, by id() of their SchedulerOutput (vLLM
        # passes the same object to update_from_output): up to k at once.
        self._nexus_steps: dict[int, _PlannedStep] = {}
        logger.info("nexus-vllm scheduler (%s): method=%s budget=%s keep_ratio=%s block=%d "
                    "chunk=%d prompt_mode=%s prefill_budget=%s blocks in pool=%d, %d steps "
                    "in flight", type(self).__name__, cfg.method, cfg.max_tokens,
                    cfg.keep_ratio, self.block_size, cfg.chunk_size, cfg.prompt_mode,
                    cfg.prefill_budget, self.nexus_manager.pool.num_usable(), k)
        # The server's policy per event kind (a request's own overrides resolve their own).
        logger.info("nexus-vllm scheduler: event policies (granularity %s):\n%s",
                    cfg.granularity, cfg.event_policies().table(cfg.granularity))

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        started = time.perf_counter()
        # An evicting request prefills in chunks even alone: it never holds more than
        # budget + one chunk.
        with lone_request_prefill_cap(self, self._nexus_lone_cap):
            output = super().schedule(*args, **kwargs)
        t0 = time.perf_counter()
        plan = self.nexus_manager.plan_step(output, self.requests)
        self.nexus_manager.counters.policy_us += int((time.perf_counter() - t0) * 1e6)
        # Self-check only (NEXUS_VLLM_SELF_CHECK=1): each request's blocks in vLLM's own
        # lists, right after vLLM allocated this step's, against its bound.
        self.nexus_manager.admission.check_pool(self.requests)
        self._nexus_sender.send(output, plan)
        self._nexus_steps[id(output)] = _PlannedStep(output, plan, started)
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput
                           ) -> dict[int, EngineCoreOutputs]:
        step = self._nexus_steps.pop(id(scheduler_output), None)
        if step is not None and step.output is not scheduler_output:
            step = None  # cannot happen while the entry holds the object; never guess
        if step is None:
            self.nexus_manager.fault("plan_unknown", "vLLM handed back a step this scheduler did not "
                             "plan; its reply is ignored")
        t0 = time.perf_counter()
        # A failure is counted as a fault and skipped inside (EvictionManager.apply_reply).
        self.nexus_manager.apply_reply(None if step is None else step.plan,
                               read_reply(model_runner_output), self.requests)
        t1 = time.perf_counter()
        out = super().update_from_output(scheduler_output, model_runner_output)
        counters = self.nexus_manager.counters
        counters.policy_us += int((t1 - t0) * 1e6)
        if step is not None:
            counters.step_us += int((time.perf_counter() - step.started) * 1e6)
        return out

    def make_stats(self, *args: Any, **kwargs: Any) -> SchedulerStats | None:
        stats = super().make_stats(*args, **kwargs)
        if stats is not None:
            # Requests that finished in this step: their peaks go out with its stats.
            self.nexus_manager.record_finished(getattr(self, "finished_req_ids", ()))
            update = self.nexus_manager.stats(self.requests)
            if self._nexus_stats_route and not attach_stats(stats, update):
                self.nexus_manager.fault("stats_field_taken", "kv_connector_stats, where "
                                         "eviction stats ride, holds a payload they cannot "
                                         "ride beside (empty, or with their key); this "
                                         "update is dropped", count=False)
        return stats


class NexusScheduler(NexusSchedulerMixin, Scheduler):
    """vLLM's ``Scheduler`` with eviction (synchronous scheduling; pipeline parallelism
    keeps one step per stage in flight)."""


class NexusAsyncScheduler(NexusSchedulerMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with eviction (async scheduling)."""
