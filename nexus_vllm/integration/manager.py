"""Scheduler-side eviction: when to score, which blocks to drop, freeing them.

The request's block list in vLLM's full-attention manager stays *logical*: an evicted
entry is replaced by the pool's shared null block (as vLLM's sliding-window manager does)
and the real block goes back to the pool at once. Token counts, positions and slot
mapping are untouched, so allocation of new blocks keeps working.

Only full, computed blocks are evicted; the policy always keeps the sink blocks (in
``prompt_mode`` ``keep``, every prompt block) and the newest ``recent_blocks + 1`` live
blocks.

Freeing at once is safe because the worker learns every null before it can read a
reused block: the next step's plan carries it (and every later plan, until the worker
acknowledges it), and a worker that misses a plan masks every block this manager may
have freed since its last applied plan (``step_plan`` module docstring).

Prefix caching stays on. Every token an evicting request computes after its first
eviction attends to a pruned context, so its KV must never be offered to another request
as a prefix hit: each request's caching is capped at its *clean watermark*, the tokens it
had computed when it first evicted (those saw the full context). Evicting a block another
request shares only drops this request's reference. The watermark is cleared when the
request restarts (preempted and resumed, possibly from a prefix hit). The other way
round, an evicting request starts from a prefix hit only up to the last chunk boundary
before its first eviction (and before that event's query window), so it gives the same
tokens with prefix caching on or off.

Every budget rule (a request's target and hard limit at each step, its admission bound,
the blocks its policy must keep, all following its ``prompt_mode``) comes from
:class:`nexus_vllm.core.EvictionConfig`, and when events fire from
:class:`nexus_vllm.core.EvictionTrigger`: the rules the transformers path runs too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.logger import init_logger

from nexus_vllm.core import EvictionTrigger, cdiv
from nexus_vllm.integration import faults
from nexus_vllm.integration.config import request_config
from nexus_vllm.integration.metrics import SchedulerCounters
from nexus_vllm.integration.step_plan import ScoreRequest, StepPlan, WorkerReply
from nexus_vllm.integration.vllm_compat import (
    BlockPoolView,
    cap_prefix_caching,
    cap_prefix_hits,
    gate_admission,
    request_blocks,
    reset_request_ids,
    single_type_manager,
)

logger = init_logger(__name__)

__all__ = ["EvictionManager", "RequestEvictionState"]


@dataclass
class RequestEvictionState:
    """Eviction state of one request (reset when it restarts after preemption, except
    ``peak_live_blocks``, the most live blocks it held over its whole life)."""

    cfg: Any
    seed: int
    prompt_tokens: int
    generator: torch.Generator = field(init=False)
    policy_state: dict[str, Any] = field(init=False)
    trigger: EvictionTrigger = field(init=False)
    tokens: int = 0  # computed tokens, as of its last scheduled step
    peak_live_blocks: int = 0

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.generator = self.cfg.generator(self.seed)
        self.policy_state = {}
        self.trigger = EvictionTrigger(self.cfg, self.prompt_tokens)
        self.tokens = 0


class EvictionManager:
    """Plans scoring, applies policy decisions, frees blocks, counts metrics.

    Parameters
    ----------
    server_cfg : EvictionConfig
        The server's config; requests may override method and budget.
    kv_cache_manager : vllm.v1.core.kv_cache_manager.KVCacheManager
    block_size : int
    """

    def __init__(self, server_cfg: Any, kv_cache_manager: Any, block_size: int,
                 max_model_len: int | None = None) -> None:
        self.server_cfg = server_cfg
        self.block_size = int(block_size)
        self.kv_group = single_type_manager(kv_cache_manager)
        self.pool = BlockPoolView(kv_cache_manager)
        self.states: dict[str, RequestEvictionState | None] = {}
        # Nulls the worker has not acknowledged: request -> {logical index: step sent
        # in (0 = not sent yet)}.
        self.unacked: dict[str, dict[int, int]] = {}
        self.step_id = 0
        # Tokens each evicting request had computed at its first eviction.
        self.clean_tokens: dict[str, int] = {}
        cap_prefix_caching(self.kv_group, lambda r: self.clean_tokens.get(r.request_id))
        cap_prefix_hits(kv_cache_manager, self._hit_cap)
        # The longest sequence (tokens) of each admitted evicting request: with its
        # progress, what it may still grow to (EvictionConfig.peak_from).
        self.max_model_len = max_model_len
        self.totals: dict[str, int] = {}
        gate_admission(kv_cache_manager, self.may_admit)
        self.counters = SchedulerCounters()
        # Counted into the stats' fault counter (reported and cleared each stats update).
        self._fault = faults.FaultLog(logger, self.counters.faults)

    # -- helpers -----------------------------------------------------------------------
    def _state(self, request: Any) -> RequestEvictionState | None:
        req_id = request.request_id
        if req_id not in self.states:
            params = request.sampling_params
            extra = getattr(params, "extra_args", None) if params is not None else None
            try:
                cfg = request_config(self.server_cfg, extra)
            except (TypeError, ValueError):
                # Validated in the API server; a request built elsewhere (Python API)
                # with bad values falls back to the server's config.
                cfg = self.server_cfg
            if cfg is None:
                self.states[req_id] = None
            else:
                seed = getattr(params, "seed", None) or 0
                self.states[req_id] = RequestEvictionState(
                    cfg=cfg, seed=int(seed), prompt_tokens=int(request.num_prompt_tokens))
        return self.states[req_id]

    def _hit_cap(self, request: Any) -> tuple[int, int] | None:
        """``(limit, multiple)`` for an evicting request's prefix hit (None: no cap).

        Its prompt is computed in ``chunk_size`` chunks with an event after the first
        chunk that leaves it over its target (:meth:`EvictionConfig.target_blocks`: in
        ``end`` mode without ``prefill_budget`` that is the prompt's last chunk, in
        ``keep`` mode none). A hit must end at a chunk boundary before that event (and on
        a block boundary), and early enough that the event's window, the newest
        ``prefill_window`` queries, is computed in this run (a short last chunk takes
        rows of the chunk before it), so the request evicts exactly as it would with
        prefix caching off.
        """
        st = self._state(request)
        if st is None:
            return None
        cfg, bs = st.cfg, self.block_size
        chunk, prompt = int(cfg.chunk_size), st.prompt_tokens
        step = math.lcm(chunk, bs)
        end = 0
        while end < prompt:
            start, end = end, min(end + chunk, prompt)
            if cdiv(end, bs) > int(cfg.target_blocks(end, prompt)):
                limit = max(0, min(start, end - int(cfg.prefill_window)))
                return (limit // step) * step, step
        return None  # no event during the prompt: any hit is safe

    # -- admission -----------------------------------------------------------------------
    def _total_tokens(self, st: RequestEvictionState, request: Any) -> int:
        """The request's longest sequence: ``max_tokens`` past its prompt, within
        ``max_model_len``."""
        total = st.prompt_tokens + int(request.max_tokens)
        if self.max_model_len is not None:
            total = min(total, int(self.max_model_len))
        return total

    def bound_blocks(self, request: Any) -> int | None:
        """Most blocks an evicting request ever holds (None: it does not evict):
        :meth:`EvictionConfig.bound_blocks` over its prompt and its longest sequence."""
        st = self._state(request)
        if st is None:
            return None
        return int(st.cfg.bound_blocks(st.prompt_tokens, self._total_tokens(st, request)))

    def may_admit(self, request: Any) -> bool:
        """Admit an evicting request only if the free pool covers its bound on top of
        what the admitted evicting requests may still grow to (each one's
        :meth:`EvictionConfig.peak_from` its progress, less what it holds: an ``end``
        request past its prompt no longer needs the prompt's peak). Then no evicting
        request is ever preempted for lack of blocks another evicting request will
        take."""
        need = self.bound_blocks(request)
        if need is None:
            return True  # not evicting: vLLM's own admission rules
        outstanding = 0
        for req_id, total in self.totals.items():
            st = self.states.get(req_id)
            if req_id != request.request_id and st is not None and self.blocks(req_id):
                peak = int(st.cfg.peak_from(st.tokens, st.prompt_tokens, total))
                outstanding += max(0, peak - self.live_count(req_id))
        if self.pool.num_free() - outstanding < need:
            self.counters.admission_waits += 1
            return False
        st = self.states.get(request.request_id)
        assert st is not None  # bound_blocks made it
        self.totals[request.request_id] = self._total_tokens(st, request)
        st.tokens = 0  # (re)starts: its whole bound is outstanding until it is scheduled
        return True

    def blocks(self, req_id: str) -> list[Any]:
        return request_blocks(self.kv_group, req_id)

    def live_indices(self, req_id: str, num_tokens: int | None = None) -> list[int]:
        blocks = self.blocks(req_id)
        if num_tokens is not None:
            blocks = blocks[: cdiv(num_tokens, self.block_size)]
        return [j for j, b in enumerate(blocks) if not BlockPoolView.is_null(b)]

    def live_count(self, req_id: str, num_tokens: int | None = None) -> int:
        return len(self.live_indices(req_id, num_tokens))

    def record_finished(self, req_ids: Any) -> None:
        """Count the peak live blocks of finished requests (once each: from the stats of
        the step they finish in, else when the next plan retires them)."""
        for req_id in req_ids:
            st = self.states.get(req_id)
            if st is not None and st.peak_live_blocks:
                self.counters.add_request_peak(st.cfg.prompt_mode, st.peak_live_blocks)
                st.peak_live_blocks = 0

    # -- schedule() --------------------------------------------------------------------
    def plan_step(self, scheduler_output: Any, requests: dict[str, Any]) -> StepPlan:
        """Build the plan for the step just scheduled (``num_computed_tokens`` already
        counts this step's tokens)."""
        self.step_id += 1
        self.record_finished(scheduler_output.finished_req_ids)
        for req_id in scheduler_output.finished_req_ids:
            self.states.pop(req_id, None)
            self.unacked.pop(req_id, None)
            self.clean_tokens.pop(req_id, None)
            self.totals.pop(req_id, None)
        resets = reset_request_ids(scheduler_output)
        for req_id in resets:
            # A fresh block list: old nulls no longer apply; same seed -> same evictions.
            self.unacked.pop(req_id, None)
            self.clean_tokens.pop(req_id, None)
            st = self.states.get(req_id)
            if st is not None:
                st.reset()
        evict: dict[str, tuple[int, ...]] = {}
        for req_id, pending in self.unacked.items():
            if pending:
                evict[req_id] = tuple(sorted(pending))
                for j, sent in pending.items():
                    if not sent:
                        pending[j] = self.step_id
        score: dict[str, ScoreRequest] = {}
        track: list[str] = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None:
                continue
            st = self._state(request)
            if st is None:
                continue
            track.append(req_id)
            sreq = self._score_request(st, request, int(n))
            if sreq is not None:
                score[req_id] = sreq
        return StepPlan(step_id=self.step_id, evict=evict, score=score, track=tuple(track),
                        sink_blocks=int(self.server_cfg.sink_blocks))

    def _score_request(self, st: RequestEvictionState, request: Any,
                       n: int) -> ScoreRequest | None:
        cfg = st.cfg
        req_id = request.request_id
        tokens_after = int(request.num_computed_tokens)
        before = tokens_after - n
        live = self.live_indices(req_id, tokens_after)
        prompt_tokens = st.prompt_tokens
        prefill = before < prompt_tokens
        # A prompt chunk is bounded as part of the prompt, also when a resumed request's
        # recompute chunk runs past the prompt's end (into its generated tokens).
        limit = cfg.hard_limit(min(tokens_after, prompt_tokens) if prefill else tokens_after,
                               prompt_tokens)
        self.counters.over_budget_peak = max(self.counters.over_budget_peak,
                                             len(live) - int(limit))
        self.counters.live_blocks_peak = max(self.counters.live_blocks_peak, len(live))
        st.peak_live_blocks = max(st.peak_live_blocks, len(live))
        st.tokens = tokens_after
        if prefill:
            due = st.trigger.prefill_chunk(tokens_after, len(live))
            # A request resumed after preemption recomputes its generated tokens inside
            # a prefill chunk: they count as decode tokens, as they did the first time.
            st.trigger.decode_tokens += max(0, tokens_after - max(before, prompt_tokens))
        else:
            due = st.trigger.decode(n, tokens_after, len(live))
        if not due:
            return None
        policy = cfg.policy(prefill=prefill, prompt_tokens=prompt_tokens)
        # The newest rows, across chunks: the worker's query ring keeps each request's
        # queries continuous over steps (a short last prompt chunk is scored with rows of
        # the chunk before it, as on the transformers path).
        window = policy.window(int(cfg.prefill_window if prefill else cfg.window))
        forced_tail = int(cfg.recent_blocks) + 1
        evictable_below = (min(live[-forced_tail], tokens_after // self.block_size)
                           if len(live) > forced_tail else 0)
        return ScoreRequest(window=window,
                            num_logical_blocks=cdiv(tokens_after, self.block_size),
                            evictable_below=evictable_below, prefill=prefill,
                            needs_mass="mass" in policy.needs,
                            needs_key_norms="key_norms" in policy.needs)

    # -- update_from_output() ----------------------------------------------------------
    def apply_reply(self, plan: StepPlan | None, reply: WorkerReply | None,
                    requests: dict[str, Any]) -> None:
        """Acknowledge the plan the worker applied; run each scored request's policy and
        evict (null + free) the dropped blocks."""
        if plan is None:
            return
        if reply is None or reply.step_id != plan.step_id:
            got = None if reply is None else reply.step_id
            self._fault("plan_unacknowledged", f"the worker did not apply plan "
                        f"{plan.step_id} (acknowledged {got}); its nulls are resent and "
                        "its scores dropped")
            if reply is not None:
                self.counters.add_faults(reply.faults)
            return
        self.counters.add_faults(reply.faults)
        for req_id in list(self.unacked):
            pending = self.unacked[req_id]
            for j in [j for j, sent in pending.items() if 0 < sent <= plan.step_id]:
                del pending[j]
            if not pending:
                del self.unacked[req_id]
        self.counters.scoring_us += int(reply.scoring_seconds * 1e6)
        for req_id, sreq in plan.score.items():
            request = requests.get(req_id)
            st = self.states.get(req_id)
            if request is None or st is None:
                continue
            norms = None
            if sreq.needs_key_norms:
                norms_np = reply.key_norms.get(req_id)
                if norms_np is None:
                    continue  # dropped by the worker (a fault it counted)
                norms = torch.from_numpy(norms_np)
            if sreq.needs_mass:
                scores = reply.masses.get(req_id)
                if scores is None:
                    continue
                mass = torch.from_numpy(scores)
            else:  # the policy reads no mass: one uniform row over the live blocks
                n = self.live_count(req_id, int(request.num_computed_tokens))
                mass = torch.full((1, n), 1.0 / max(1, n))
            try:
                if faults.fires("policy_error"):
                    raise RuntimeError("injected policy failure")
                self._evict(req_id, request, st, sreq, mass, norms)
            except Exception:
                # A policy error skips this event: nothing was freed (freeing is the
                # last step of _evict), so the worker's view stays consistent.
                self._fault("policy_error", "eviction policy failed; skipping this event",
                            exc=True)

    def _evict(self, req_id: str, request: Any, st: RequestEvictionState,
               sreq: ScoreRequest, mass: torch.Tensor,
               key_norms: torch.Tensor | None = None) -> None:
        blocks = self.blocks(req_id)
        live = [j for j in range(min(sreq.num_logical_blocks, len(blocks)))
                if not BlockPoolView.is_null(blocks[j])]
        if len(live) != mass.shape[1]:
            self._fault("stale_scores", "scores do not match the request's live blocks; "
                        "skipping this event")
            return
        tokens = int(request.num_computed_tokens)
        budget = int(st.cfg.target_blocks(tokens, st.prompt_tokens))
        if len(live) <= budget:
            return
        policy = st.cfg.policy(prefill=sreq.prefill, prompt_tokens=st.prompt_tokens)
        keep = policy.select(mass, budget, generator=st.generator, state=st.policy_state,
                             key_norms=key_norms)
        keep_set = {int(i) for i in keep.tolist()}
        full_blocks = tokens // self.block_size
        evict = [live[j] for j in range(len(live))
                 if j not in keep_set and live[j] < min(full_blocks, sreq.evictable_below)]
        if not evict:
            return
        # Everything computed so far saw the full context; nothing after this will.
        self.clean_tokens.setdefault(req_id, tokens)
        freed = [blocks[j] for j in evict]
        for j in evict:
            blocks[j] = self.pool.null_block
        pending = self.unacked.setdefault(req_id, {})
        for j in evict:
            pending[j] = 0
        self.pool.free(freed)
        self.counters.evicted_blocks += len(evict)
        self.counters.eviction_events += 1

    # -- make_stats() ------------------------------------------------------------------
    def stats(self, requests: dict[str, Any]) -> dict[str, int]:
        live = [self.live_count(r) for r, st in self.states.items()
                if st is not None and r in requests]
        self.counters.set_gauges(
            live_blocks=sum(live),
            live_blocks_max=max(live, default=0),
            free_blocks=self.pool.num_free(),
            total_blocks=self.pool.num_usable(),
        )
        return self.counters.drain()
