"""Admission of evicting requests: reserve each one's bound before it starts.

An evicting request is admitted only if the free pool covers its bound
(:func:`~nexus_vllm.core.budget.bound_blocks`, the most blocks it ever holds) on top of what the
admitted evicting requests may still grow to. Then no evicting request is ever preempted
for lack of blocks another evicting request will take. What an admitted request reserves
is its state's ``admitted_total`` (its longest sequence), with its progress. A request
resumed after a preemption (by something else: requests that do not evict, a prefix-cache
reset) recomputes the tokens it generated within its prefill, and reserves for that too.

With ``NEXUS_VLLM_SELF_CHECK=1`` the gate also checks what it reserved against vLLM's
pool (:meth:`AdmissionGate.check_pool`, after each ``schedule()``): each evicting
request's blocks, counted in vLLM's own block lists, never above its bound.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm.logger import init_logger

from nexus_vllm.core.admission import admits
from nexus_vllm.core.budget import bound_blocks, peak_from
from nexus_vllm.integration.compat.vllm_types import EngineRequest
from nexus_vllm.integration.config import self_check_enabled
from nexus_vllm.integration.metrics import SchedulerCounters
from nexus_vllm.integration.scheduler.live_blocks import LiveBlocks, PoolPeaks, WindowBlocks
from nexus_vllm.integration.scheduler.request_state import RequestEvictionState, RequestStates

logger = init_logger(__name__)

__all__ = ["AdmissionGate"]


class AdmissionGate:
    """Bounds of evicting requests and the admission decision over them.

    Parameters
    ----------
    states : RequestStates
    blocks : LiveBlocks
    counters : SchedulerCounters
        ``admission_waits`` counts each refusal.
    max_model_len : int, optional
        The longest sequence vLLM allows (None: ``max_tokens`` alone bounds it).
    windows : WindowBlocks, optional
        The sliding-window groups' blocks, reserved on top of the evicted group's bound
        and reserve, by the request's phase (a full-attention model has none).
    pool_check : bool, optional
        Run :meth:`check_pool` (default: ``NEXUS_VLLM_SELF_CHECK=1`` in the environment).
    """

    def __init__(self, states: RequestStates, blocks: LiveBlocks, counters: SchedulerCounters,
                 max_model_len: int | None = None, windows: WindowBlocks | None = None,
                 pool_check: bool | None = None) -> None:
        self.states = states
        self.blocks = blocks
        self.windows = windows if windows is not None else WindowBlocks((), 0)
        self.counters = counters
        self.max_model_len = max_model_len
        if pool_check is None:
            pool_check = self_check_enabled()
        self.pool = PoolPeaks(blocks) if pool_check else None
        self._reported: set[str] = set()

    def total_tokens(self, st: RequestEvictionState, request: EngineRequest) -> int:
        """The request's longest sequence: ``max_tokens`` past its prompt, within
        ``max_model_len``."""
        total = st.prompt_tokens + int(request.max_tokens)
        if self.max_model_len is not None:
            total = min(total, int(self.max_model_len))
        return total

    def recompute_tokens(self, request: EngineRequest) -> int:
        """Tokens the request computes before it decodes, where that is more than its
        prompt (else 0): a request resumed after preemption recomputes its prompt and
        the tokens it generated (vLLM's ``num_tokens``, read while it has computed
        nothing; once it runs, what it was admitted with)."""
        if int(request.num_computed_tokens) == 0:
            # Not a field of every stand-in for vLLM's Request: none there is a new one.
            return int(getattr(request, "num_tokens", 0))
        st = self.states.get(request.request_id)
        return 0 if st is None else st.recompute_tokens

    def bound_blocks(self, request: EngineRequest) -> int | None:
        """Most blocks an evicting request ever holds in the evicted group (None: it
        does not evict): :func:`~nexus_vllm.core.budget.bound_blocks` over its prompt, its
        longest sequence and what it recomputes if it resumes after preemption."""
        st = self.states.resolve(request)
        if st is None:
            return None
        return int(bound_blocks(st.cfg, st.prompt_tokens, self.total_tokens(st, request),
                                       recompute_tokens=self.recompute_tokens(request)))

    def _window_reserve(self, st: RequestEvictionState, total_tokens: int) -> int:
        """What a started request may still hold in the sliding-window groups, by its
        phase: its prompt (or a resumed request's recompute) until it is computed
        (:meth:`WindowBlocks.allowance`)."""
        return self.windows.allowance(total_tokens, st.tokens,
                                      max(st.prompt_tokens, st.recompute_tokens))

    def _reserve(self, st: RequestEvictionState) -> int:
        """What an admitted request may still come to hold
        (:func:`~nexus_vllm.core.budget.peak_from` its progress; a resumed one its
        recompute's peak until it is done)."""
        assert st.admitted_total is not None
        peak = peak_from(st.cfg, st.tokens, st.prompt_tokens, st.admitted_total)
        recompute = st.recompute_tokens
        if st.tokens < recompute:
            peak = max(peak, bound_blocks(st.cfg, st.prompt_tokens, st.admitted_total,
                                                 recompute_tokens=recompute))
        return int(peak)

    def may_admit(self, request: EngineRequest) -> bool:
        """Admit an evicting request only if the free pool covers its bound on top of
        what the admitted evicting requests may still grow to (each one's
        :func:`~nexus_vllm.core.budget.peak_from` its progress, less what it holds: an ``end``
        request past its prompt no longer needs the prompt's peak)."""
        need = self.bound_blocks(request)
        if need is None:
            return True  # not evicting: vLLM's own admission rules
        windows = self.windows
        st_new = self.states.get(request.request_id)
        assert st_new is not None  # bound_blocks resolved it
        need += windows.allowance(self.total_tokens(st_new, request))
        # The window groups' reserve follows the phase: k steps while the prompt (or a
        # recompute) is computed (each at most the chunk where the server caps prompt
        # steps), k decode tokens after (WindowBlocks.allowance).
        reserved = ((self._reserve(st) + self._window_reserve(st, st.admitted_total),
                     self.blocks.live_count(st) + windows.held(req_id))
                    for req_id, st in self.states.items()
                    if st.admitted_total is not None and req_id != request.request_id
                    and self.blocks.of(req_id))
        if not admits(need, self.blocks.pool.num_free(), reserved):
            self.counters.admission_waits += 1
            return False
        admitted = self.states.get(request.request_id)
        assert admitted is not None  # bound_blocks made it
        admitted.admitted_total = self.total_tokens(admitted, request)
        admitted.tokens = 0  # (re)starts: its whole bound is outstanding until scheduled
        recompute = self.recompute_tokens(request)
        admitted.recompute_tokens = recompute if recompute > admitted.prompt_tokens else 0
        return True

    def check_pool(self, requests: Mapping[str, EngineRequest]) -> None:
        """Self-check of the bounds in vLLM's pool (nothing unless enabled, see
        ``pool_check``): each evicting request's blocks in the evicted group, counted in
        vLLM's own block list (:class:`PoolPeaks`), against its :meth:`bound_blocks`.

        Call it once vLLM has allocated a step's blocks (after ``schedule()``). A request
        above its bound, or whose live index disagrees with vLLM's list, or holding more
        in the sliding-window groups than :meth:`WindowBlocks.allowance`, is logged once;
        the high-water marks ride with the stats as ``pool_blocks_peak`` (the most blocks
        one request held) and ``pool_over_bound`` (the most one held above its bound:
        <= 0 while every bound holds).
        """
        pool = self.pool
        if pool is None:
            return
        seen = set()
        for req_id, st in self.states.items():
            request = requests.get(req_id)
            if request is None:
                continue
            seen.add(req_id)
            bound = int(bound_blocks(st.cfg,
                st.prompt_tokens, self.total_tokens(st, request),
                recompute_tokens=st.recompute_tokens))
            held = pool.observe(req_id, bound)
            indexed = self.blocks.live_count(st)
            if (held > bound or held != indexed) and req_id not in self._reported:
                self._reported.add(req_id)
                logger.warning(
                    "nexus-vllm self-check: request %s holds %d blocks in vLLM's pool "
                    "(its live index: %d) against a bound of %d (prompt %d tokens, "
                    "longest sequence %d, prompt_mode %s)", req_id, held, indexed, bound,
                    st.prompt_tokens, self.total_tokens(st, request), st.cfg.prompt_mode)
            if self.windows.groups and req_id not in self._reported:
                # What admission keeps reserved for it from this step on.
                held = self.windows.held(req_id)
                allowance = self._window_reserve(st, self.total_tokens(st, request))
                if held > allowance:
                    self._reported.add(req_id)
                    logger.warning(
                        "nexus-vllm self-check: request %s holds %d blocks in its "
                        "sliding-window groups against an allowance of %d (%d tokens "
                        "computed, prompt %d tokens)", req_id, held, allowance, st.tokens,
                        st.prompt_tokens)
        gone = [r for r in pool.peaks if r not in seen]
        pool.forget(gone)
        self._reported.difference_update(gone)
        gauges = {"pool_blocks_peak": pool.peak}
        if pool.over_bound is not None:
            gauges["pool_over_bound"] = pool.over_bound
        self.counters.set_gauges(**gauges)
