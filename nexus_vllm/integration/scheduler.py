"""Scheduler subclass selected by ``scheduler_cls`` for evicting configurations.

``schedule()`` attaches the step's :class:`~nexus_vllm.integration.channel.StepPlan` to
the ``SchedulerOutput``; ``update_from_output()`` reads the worker's block masses, runs
each request's policy and frees the evicted blocks *before* vLLM frees finished requests
and schedules the next step; ``make_stats()`` adds the ``nexus:*`` metrics.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler

from nexus_vllm.integration.channel import PLAN_ATTR, SCORES_ATTR
from nexus_vllm.integration.config import config_from_additional
from nexus_vllm.integration.manager import EvictionManager

logger = init_logger(__name__)

__all__ = ["NexusScheduler"]


class NexusScheduler(Scheduler):
    """vLLM's scheduler + streaming KV eviction under a per-request budget."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = config_from_additional(self.vllm_config.additional_config)
        if cfg is None:
            raise ValueError("NexusScheduler needs additional_config['nexus'] with a method "
                             "other than 'none' (use --kv-eviction)")
        if self.block_size != cfg.block_size:
            cfg = cfg.replace(block_size=int(self.block_size))
        self.nexus = EvictionManager(cfg, self.kv_cache_manager, self.block_size)
        logger.info("nexus-vllm scheduler: method=%s budget=%s keep_ratio=%s block=%d "
                    "chunk=%d blocks in pool=%d", cfg.method, cfg.max_tokens, cfg.keep_ratio,
                    self.block_size, cfg.chunk_size,
                    self.kv_cache_manager.block_pool.num_gpu_blocks)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._nexus_first_count = True
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self._nexus_first_count = False
        setattr(output, PLAN_ATTR, self.nexus.plan_step(output, self.requests))
        return output

    def get_request_counts(self) -> tuple[int, int]:
        running, waiting = super().get_request_counts()
        # vLLM 0.32 drops the per-request prefill cap (long_prefill_token_threshold)
        # when only one request is eligible; an evicting request must still prefill in
        # chunks so it never holds more than budget + one chunk. The first count taken
        # inside schedule() is the one that decides the cap.
        if getattr(self, "_nexus_first_count", False):
            self._nexus_first_count = False
            if running + waiting == 1:
                return running, waiting + 1
        return running, waiting

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        scores = getattr(model_runner_output, SCORES_ATTR, None)
        if scores:
            try:
                self.nexus.apply_scores(scores, self.requests,
                                        getattr(scheduler_output, PLAN_ATTR, None))
            except Exception:
                # A policy error must not kill the engine; blocks stay allocated (never
                # freed without the worker being told), so skipping an event is safe.
                logger.exception("nexus-vllm: eviction step failed; skipping it")
        return super().update_from_output(scheduler_output, model_runner_output)

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        stats = super().make_stats(*args, **kwargs)
        if stats is not None:
            counts = dict(stats.num_kv_fetch_reqs_by_stage)
            counts.update(self.nexus.stats(self.requests))
            stats.num_kv_fetch_reqs_by_stage = counts
        return stats
