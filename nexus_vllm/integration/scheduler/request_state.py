"""Everything the scheduler keeps for one evicting request, in one object.

:class:`RequestStates` resolves a request's config once (the server's, with the request's
``vllm_xargs`` overrides) and keeps one :class:`RequestEvictionState` per evicting request
until it finishes. The manager's parts (``live_blocks``, ``admission``, ``prefix_cache``,
``plan_channel``, ``evictor``) keep nothing per request themselves: they read and write
the fields of that state. So a request's end is one :meth:`RequestStates.finish` (its
state goes, and everything in it), and a restart after preemption is one
:meth:`RequestEvictionState.restart`, which states what survives.

:meth:`RequestEvictionState.plan_event` is the budget trigger of one scheduled step: it
decides, from the request's progress and live blocks, whether an eviction event is due
and what the worker must score for it.

vLLM may schedule up to ``k`` steps before the first one's output comes back (pipeline
parallelism, async scheduling). A request has at most one eviction event in flight
(:class:`InFlightEvent`): the manager holds it out of vLLM's schedule until the event's
reply is applied, so every event is planned on a view that already holds the previous
event's nulls, exactly as with one step in flight, and the request's budget bounds do not
grow with ``k``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nexus_vllm.core import EvictionConfig, EvictionTrigger, cdiv, forced_tail
from nexus_vllm.core.budget import hard_limit
from nexus_vllm.core.event_policies import EventPolicies
from nexus_vllm.integration.compat.vllm_types import EngineRequest, KVBlock
from nexus_vllm.integration.config import request_config
from nexus_vllm.integration.protocol import ScoreRequest

__all__ = ["InFlightEvent", "LiveIndex", "RequestEvictionState", "RequestStates"]


@dataclass(frozen=True)
class InFlightEvent:
    """A request's eviction event between its plan and its reply.

    Attributes
    ----------
    step_id : int
        The plan that asked for it.
    resume_step : int
        vLLM's own ``next_decode_eligible_step`` of the request, put back when the
        request is released (``vllm_compat.hold_request``).
    """

    step_id: int
    resume_step: int


@dataclass
class LiveIndex:
    """The live entries of one request's block list, kept as the list grows and as
    eviction nulls entries (``live_blocks.LiveBlocks`` keeps it), so that a step never
    reads the whole list.

    Attributes
    ----------
    blocks : list or None
        The vLLM block list this index describes (None: not read yet). vLLM gives a
        request a new list object when it (re)starts, so the identity tells a fresh list.
    live : list[int]
        Logical indices of the live entries among the first ``seen``, ascending.
    seen : int
        Entries of ``blocks`` read so far.
    """

    blocks: list[KVBlock] | None = None
    live: list[int] = field(default_factory=list)
    seen: int = 0


@dataclass
class RequestEvictionState:
    """Eviction state of one request, from its first sight to its end.

    Attributes
    ----------
    req_id : str
    cfg : EvictionConfig
        The config it runs with (the server's with its ``vllm_xargs`` overrides).
    seed : int
        Its sampling seed: the policy's generator is seeded from it.
    prompt_tokens : int
    policies : EventPolicies
        The policy of each of its event kinds, resolved once from ``cfg``.
    generator, policy_state, trigger
        Its policy's generator and per-request state, and its event clock.
    tokens : int
        Computed tokens, as of its last scheduled step (0 again when it is admitted).
    unacked : dict[int, int]
        Nulls the worker has not acknowledged: logical block index -> the id of the
        first plan that carried it (0: not sent yet). Kept by ``plan_channel``.
    clean_watermark : int or None
        Tokens it had computed at its first eviction: the most of its KV the prefix
        cache may publish (None: it has not evicted). Set by ``prefix_cache``.
    live : LiveIndex
        Its live blocks, kept by ``live_blocks``.
    admitted_total : int or None
        Its longest sequence in tokens, from its admission on (None: not admitted).
        Kept by ``admission``; it survives a restart (the request stays admitted).
    recompute_tokens : int
        Tokens it recomputes before it decodes when resumed after a preemption, where
        that is more than its prompt (else 0). Kept by ``admission``.
    peak_live_blocks : int
        The most live blocks it held over its whole life (survives a restart); taken
        once when it finishes, for the metrics.
    event_in_flight : InFlightEvent or None
        Its eviction event whose reply has not been applied yet (the request is held out
        of vLLM's schedule meanwhile); set and cleared by the manager.
    """

    req_id: str
    cfg: EvictionConfig
    seed: int
    prompt_tokens: int
    policies: EventPolicies = field(init=False)
    generator: torch.Generator = field(init=False)
    policy_state: dict[str, Any] = field(init=False)
    trigger: EvictionTrigger = field(init=False)
    tokens: int = field(init=False)
    unacked: dict[int, int] = field(init=False)
    clean_watermark: int | None = field(init=False)
    live: LiveIndex = field(init=False)
    admitted_total: int | None = None
    recompute_tokens: int = 0
    peak_live_blocks: int = 0
    event_in_flight: InFlightEvent | None = field(init=False)

    def __post_init__(self) -> None:
        self.policies = self.cfg.event_policies(self.prompt_tokens)
        self.restart()

    def restart(self) -> None:
        """Start over from token 0 with a fresh block list (a new request, or one
        preempted and resumed: its KV is recomputed). The same seed gives the same
        evictions; nulls addressed to the old block list, its clean watermark and an
        event in flight no longer apply (the manager releases the request first).
        ``admitted_total`` and ``peak_live_blocks`` survive."""
        self.generator = self.cfg.generator(self.seed)
        self.policy_state = {}
        self.trigger = EvictionTrigger(self.cfg, self.prompt_tokens)
        self.tokens = 0
        self.unacked = {}
        self.clean_watermark = None
        self.live = LiveIndex()
        self.event_in_flight = None  # planned on the old list: its reply is dropped

    def hard_limit(self, tokens_after: int, scheduled: int) -> int:
        """The most live blocks the request may hold after a step of ``scheduled`` tokens
        that leaves ``tokens_after`` computed (:func:`~nexus_vllm.core.budget.hard_limit`).

        A prompt chunk is bounded as part of the prompt, also when a resumed request's
        recompute chunk runs past the prompt's end (into its generated tokens).
        """
        prompt_tokens = self.prompt_tokens
        prefill = tokens_after - scheduled < prompt_tokens
        return int(hard_limit(self.cfg, min(tokens_after, prompt_tokens) if prefill
                                       else tokens_after, prompt_tokens))

    def plan_event(self, tokens_after: int, scheduled: int, live: Sequence[int],
                   block_size: int, *, epoch: int = 0,
                   may_fire: bool = True) -> ScoreRequest | None:
        """Advance the trigger over one scheduled step; the scoring an event needs, or
        None when no event is due.

        Parameters
        ----------
        tokens_after : int
            Computed tokens once the step runs (vLLM's ``num_computed_tokens`` after
            ``schedule()``).
        scheduled : int
            Tokens the step computes.
        live : Sequence[int]
            Logical indices of the request's live blocks among its first
            ``ceil(tokens_after / block_size)``, ascending.
        block_size : int
        epoch : int
            The request's preemption count now (``ScoreRequest.epoch``).
        may_fire : bool
            False while an event of the request is still in flight: a due event waits
            (the trigger keeps counting, so it fires at the first step allowed).
        """
        cfg = self.cfg
        self.peak_live_blocks = max(self.peak_live_blocks, len(live))
        self.tokens = tokens_after
        event = self.trigger.advance(tokens_after, len(live), scheduled, may_fire=may_fire)
        if event is None:
            return None
        prefill = event == "prefill"
        prompt_end = self.trigger.ends_prompt(prefill)
        policy = self.policies.at(prefill=prefill, prompt_end=prompt_end)
        # The newest rows, across chunks: the worker's query ring keeps each request's
        # queries continuous over steps (a short last prompt chunk is scored with rows of
        # the chunk before it, as on the transformers path).
        window = policy.window(int(cfg.prompt_window if prefill else cfg.window))
        tail = forced_tail(cfg.recent_blocks)
        evictable_below = (min(live[-tail], tokens_after // block_size)
                           if len(live) > tail else 0)
        return ScoreRequest(window=window,
                            num_logical_blocks=cdiv(tokens_after, block_size),
                            evictable_below=evictable_below, prefill=prefill,
                            prompt_end=prompt_end, kinds=frozenset(policy.needs),
                            tokens_after=tokens_after, epoch=int(epoch))


class RequestStates:
    """The one map of per-request state: each request's :class:`RequestEvictionState`,
    by request id (None for a request that does not evict).

    Parameters
    ----------
    server_cfg : EvictionConfig
        The server's config; requests may override method, budget and prompt mode.
    """

    def __init__(self, server_cfg: EvictionConfig) -> None:
        self.server_cfg = server_cfg
        self._states: dict[str, RequestEvictionState | None] = {}

    def resolve(self, request: EngineRequest) -> RequestEvictionState | None:
        """The request's state, made on first sight from its sampling params."""
        req_id = request.request_id
        if req_id not in self._states:
            params = request.sampling_params
            extra = getattr(params, "extra_args", None) if params is not None else None
            cfg: EvictionConfig | None
            try:
                cfg = request_config(self.server_cfg, extra)
            except (TypeError, ValueError):
                # Validated in the API server; a request built elsewhere (Python API)
                # with bad values falls back to the server's config.
                cfg = self.server_cfg
            if cfg is None:
                self._states[req_id] = None
            else:
                seed = getattr(params, "seed", None) or 0
                self._states[req_id] = RequestEvictionState(
                    req_id=req_id, cfg=cfg, seed=int(seed),
                    prompt_tokens=int(request.num_prompt_tokens))
        return self._states[req_id]

    def get(self, req_id: str) -> RequestEvictionState | None:
        """The state of a request seen before (None: unseen, or it does not evict)."""
        return self._states.get(req_id)

    def items(self) -> Iterator[tuple[str, RequestEvictionState]]:
        """``(request id, state)`` of every evicting request seen and not finished."""
        return ((r, st) for r, st in self._states.items() if st is not None)

    def restart(self, req_id: str) -> None:
        """The request restarts from token 0 (:meth:`RequestEvictionState.restart`)."""
        st = self._states.get(req_id)
        if st is not None:
            st.restart()

    def finish(self, req_id: str) -> None:
        """The request finished: its state goes, and with it everything kept for it."""
        self._states.pop(req_id, None)

    def take_peaks(self, req_ids: Iterable[str]) -> list[tuple[str, int]]:
        """``(prompt_mode, peak live blocks)`` of each of these requests not taken yet
        (a finished request's peak is reported once)."""
        peaks = []
        for req_id in req_ids:
            st = self._states.get(req_id)
            if st is not None and st.peak_live_blocks:
                peaks.append((str(st.cfg.prompt_mode), st.peak_live_blocks))
                st.peak_live_blocks = 0
        return peaks
