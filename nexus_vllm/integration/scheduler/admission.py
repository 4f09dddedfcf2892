"""Admission of evicting requests: reserve each one's bound before it starts.

An evicting request is admitted only if the free pool covers its bound
(:meth:`EvictionConfig.bound_blocks`, the most blocks it ever holds) on top of what the
admitted evicting requests may still grow to. Then no evicting request is ever preempted
for lack of blocks another evicting request will take. What an admitted request reserves
is its state's ``admitted_total`` (its longest sequence), with its progress.
"""

from __future__ import annotations

from nexus_vllm.core.admission import admits
from nexus_vllm.integration.compat.vllm_types import EngineRequest
from nexus_vllm.integration.metrics import SchedulerCounters
from nexus_vllm.integration.scheduler.live_blocks import LiveBlocks, WindowBlocks
from nexus_vllm.integration.scheduler.request_state import RequestEvictionState, RequestStates

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
        (a full-attention model has none).
    """

    def __init__(self, states: RequestStates, blocks: LiveBlocks, counters: SchedulerCounters,
                 max_model_len: int | None = None, windows: WindowBlocks | None = None
                 ) -> None:
        self.states = states
        self.blocks = blocks
        self.windows = windows if windows is not None else WindowBlocks((), 0)
        self.counters = counters
        self.max_model_len = max_model_len

    def total_tokens(self, st: RequestEvictionState, request: EngineRequest) -> int:
        """The request's longest sequence: ``max_tokens`` past its prompt, within
        ``max_model_len``."""
        total = st.prompt_tokens + int(request.max_tokens)
        if self.max_model_len is not None:
            total = min(total, int(self.max_model_len))
        return total

    def bound_blocks(self, request: EngineRequest) -> int | None:
        """Most blocks an evicting request ever holds in the evicted group (None: it
        does not evict): :meth:`EvictionConfig.bound_blocks` over its prompt and its
        longest sequence."""
        st = self.states.resolve(request)
        if st is None:
            return None
        return int(st.cfg.bound_blocks(st.prompt_tokens, self.total_tokens(st, request)))

    def may_admit(self, request: EngineRequest) -> bool:
        """Admit an evicting request only if the free pool covers its bound on top of
        what the admitted evicting requests may still grow to (each one's
        :meth:`EvictionConfig.peak_from` its progress, less what it holds: an ``end``
        request past its prompt no longer needs the prompt's peak)."""
        need = self.bound_blocks(request)
        if need is None:
            return True  # not evicting: vLLM's own admission rules
        windows = self.windows
        st_new = self.states.get(request.request_id)
        assert st_new is not None  # bound_blocks resolved it
        need += windows.allowance(self.total_tokens(st_new, request))
        reserved = ((st.cfg.peak_from(st.tokens, st.prompt_tokens, st.admitted_total)
                     + windows.allowance(st.admitted_total),
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
        return True
