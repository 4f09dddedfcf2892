"""Scheduler-side eviction: when to score, which blocks to drop, freeing them.

The request's block list in vLLM's ``FullAttentionManager`` (``req_to_blocks``) stays
logical: an evicted entry is replaced by the pool's shared null block (never
ref-counted, as the sliding-window manager does) and the real block goes back to the
pool at once. Token counts, positions and slot mapping are untouched, so allocation of
new blocks (``cdiv(tokens, block_size) - len(blocks)``) keeps working.

Only full, computed blocks are evicted; the policy always keeps the sink blocks and the
newest ``recent_blocks + 1`` blocks. Prefix caching is off for evicting configurations,
so no evicted block is shared with another request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nexus_vllm.integration.channel import ScoreRequest, ScoreResult, StepPlan
from nexus_vllm.integration.config import request_config
from nexus_vllm.integration.metrics import SchedulerCounters

__all__ = ["EvictionManager", "RequestEvictionState"]


@dataclass
class RequestEvictionState:
    """Eviction state of one request (reset when it restarts after preemption)."""

    cfg: Any
    seed: int
    generator: torch.Generator | None = None
    policy_state: dict[str, Any] = field(default_factory=dict)
    decode_tokens: int = 0

    def reset(self) -> None:
        self.generator = self.cfg.generator(self.seed)
        self.policy_state = {}
        self.decode_tokens = 0


class EvictionManager:
    """Plans scoring, applies policy decisions, frees blocks, counts metrics.

    Parameters
    ----------
    server_cfg : EvictionConfig
        The server's config; requests may override method and budget.
    kv_cache_manager : vllm.v1.core.kv_cache_manager.KVCacheManager
    block_size : int
    """

    def __init__(self, server_cfg: Any, kv_cache_manager: Any, block_size: int) -> None:
        managers = kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1:
            raise ValueError(
                "nexus-vllm eviction supports models with one KV cache group (full "
                f"attention); this model has {len(managers)}"
            )
        self.server_cfg = server_cfg
        self.block_size = int(block_size)
        self.single = managers[0]
        self.block_pool = kv_cache_manager.block_pool
        self.null_block = self.block_pool.null_block
        self.states: dict[str, RequestEvictionState | None] = {}
        self.pending_evict: dict[str, list[int]] = {}
        self.counters = SchedulerCounters()
        self.chunk_blocks = -(-int(server_cfg.chunk_size) // self.block_size)

    # -- helpers -----------------------------------------------------------------------
    def _state(self, request: Any) -> RequestEvictionState | None:
        req_id = request.request_id
        if req_id not in self.states:
            params = request.sampling_params
            extra = getattr(params, "extra_args", None) if params is not None else None
            try:
                cfg = request_config(self.server_cfg, extra)
            except ValueError:
                # Validated in the API server; a request built elsewhere (Python API)
                # with bad values falls back to the server's config.
                cfg = self.server_cfg
            if cfg is None:
                self.states[req_id] = None
            else:
                seed = getattr(params, "seed", None) or 0
                st = RequestEvictionState(cfg=cfg, seed=int(seed))
                st.reset()
                self.states[req_id] = st
        return self.states[req_id]

    def blocks(self, req_id: str) -> list[Any]:
        return self.single.req_to_blocks.get(req_id, [])

    def live_count(self, req_id: str, num_tokens: int | None = None) -> int:
        blocks = self.blocks(req_id)
        if num_tokens is not None:
            blocks = blocks[: -(-num_tokens // self.block_size)]
        return sum(1 for b in blocks if not b.is_null)

    # -- schedule() --------------------------------------------------------------------
    def plan_step(self, scheduler_output: Any, requests: dict[str, Any]) -> StepPlan:
        """Build the plan for the step just scheduled (``num_computed_tokens`` already
        counts this step's tokens)."""
        for req_id in scheduler_output.finished_req_ids:
            self.states.pop(req_id, None)
            self.pending_evict.pop(req_id, None)
        plan = StepPlan(evict=self.pending_evict, max_window=1,
                        skip_layers=int(self.server_cfg.skip_layers))
        self.pending_evict = {}
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None:
                continue
            st = self._state(request)
            if st is None:
                continue
            cfg = st.cfg
            tokens_after = int(request.num_computed_tokens)
            before = tokens_after - int(n)
            if before == 0:
                # New, or restarted after preemption: same seed -> same evictions.
                st.reset()
                plan.reset.append(req_id)
                plan.evict.pop(req_id, None)
            plan.track.append(req_id)
            plan.max_window = max(plan.max_window, int(cfg.window), int(cfg.prefill_window))
            plan.skip_layers = int(cfg.skip_layers)
            num_logical = -(-tokens_after // self.block_size)
            live = self.live_count(req_id, tokens_after)
            budget = int(cfg.budget_blocks(tokens_after))
            prefill = before < int(request.num_prompt_tokens)
            over = live - (budget + self.chunk_blocks)
            self.counters.over_budget_peak = max(self.counters.over_budget_peak, over)
            self.counters.live_blocks_peak = max(self.counters.live_blocks_peak, live)
            if live <= budget:
                if not prefill:
                    st.decode_tokens += int(n)
                continue
            if prefill:
                due = True
                window = int(cfg.prefill_window)
            else:
                st.decode_tokens += int(n)
                due = st.decode_tokens >= int(cfg.interval) or over >= 0
                window = int(cfg.window)
            if due:
                st.decode_tokens = 0
                plan.score[req_id] = ScoreRequest(window=window,
                                                  num_logical_blocks=num_logical,
                                                  prefill=prefill)
        return plan

    # -- update_from_output() ----------------------------------------------------------
    def apply_scores(self, scores: dict[str, ScoreResult], requests: dict[str, Any],
                     plan: StepPlan | None) -> None:
        """Run each scored request's policy and evict (null + free) the dropped blocks."""
        for req_id, res in scores.items():
            request = requests.get(req_id)
            st = self.states.get(req_id)
            if request is None or st is None:
                continue
            self.counters.scoring_us += int(res.seconds * 1e6)
            blocks = self.blocks(req_id)
            live = [j for j in res.live if j < len(blocks) and not blocks[j].is_null]
            if len(live) != len(res.live):
                continue  # stale scores (table changed since): skip this event
            tokens = int(request.num_computed_tokens)
            budget = int(st.cfg.budget_blocks(tokens))
            if len(live) <= budget:
                continue
            sreq = plan.score.get(req_id) if plan is not None else None
            policy = st.cfg.policy(prefill=bool(sreq is not None and sreq.prefill))
            keep = policy.select(res.mass, budget, generator=st.generator,
                                 state=st.policy_state)
            keep_set = set(int(i) for i in keep.tolist())
            full_blocks = tokens // self.block_size
            evict = [live[j] for j in range(len(live))
                     if j not in keep_set and live[j] < full_blocks]
            if not evict:
                continue
            freed = [blocks[j] for j in evict]
            for j in evict:
                blocks[j] = self.null_block
            self.block_pool.free_blocks(freed)
            self.pending_evict.setdefault(req_id, []).extend(evict)
            self.counters.evicted_blocks += len(evict)
            self.counters.eviction_events += 1

    # -- make_stats() ------------------------------------------------------------------
    def stats(self, requests: dict[str, Any]) -> dict[str, int]:
        live = [self.live_count(r) for r, st in self.states.items()
                if st is not None and r in requests]
        self.counters.set_gauges(
            live_blocks=sum(live),
            live_blocks_max=max(live, default=0),
            free_blocks=self.block_pool.get_num_free_blocks(),
            total_blocks=self.block_pool.num_gpu_blocks - 1,
        )
        return self.counters.drain()
