"""Prefix caching with evicting requests: what they publish, and what hit they start from.

Every token an evicting request computes after its first eviction attends to a pruned
context, so its KV must never be offered to another request as a prefix hit: each
request's caching is capped at its *clean watermark* (``RequestEvictionState.
clean_watermark``, set by :func:`mark_first_eviction`), the tokens it had computed when it
first evicted (those saw the full context). The watermark is cleared when the request
restarts (preempted and resumed, possibly from a prefix hit).

The other way round, an evicting request starts from a prefix hit only up to its first
eviction event's query window, and where events fire during the prompt, up to the chunk
boundary before that event (:func:`prefix_hit_cap`), so it evicts the same blocks with
prefix caching on or off.
"""

from __future__ import annotations

import math

from nexus_vllm.core import EvictionConfig, first_prompt_event
from nexus_vllm.core.budget import evicts_mid_prompt
from nexus_vllm.integration.scheduler.request_state import RequestEvictionState

__all__ = ["mark_first_eviction", "prefix_hit_cap"]


def prefix_hit_cap(cfg: EvictionConfig, prompt_tokens: int,
                   block_size: int) -> tuple[int, int] | None:
    """``(limit, multiple)`` for an evicting request's prefix hit (None: no cap).

    The hit must leave the request's first prompt event as it would be with prefix
    caching off (:func:`~nexus_vllm.core.first_prompt_event`, the trigger's rule): that
    event's window, the newest ``prompt_window`` queries, must be computed in this run
    (a short last chunk takes rows of the chunk before it). Where events fire during the
    prompt (:func:`~nexus_vllm.core.budget.evicts_mid_prompt`), each follows a ``chunk_size``
    chunk, so the hit must also end on a chunk boundary before the event's chunk; where
    only the prompt's end fires, any block boundary before the window will do.

    Parameters
    ----------
    cfg : EvictionConfig
        The request's config.
    prompt_tokens : int
    block_size : int
    """
    bs = int(block_size)
    event = first_prompt_event(cfg, int(prompt_tokens))
    if event is None:
        return None  # no event during the prompt: any hit is safe
    start, end = event
    limit = end - int(cfg.prompt_window)
    step = bs
    if evicts_mid_prompt(cfg):
        limit, step = min(start, limit), math.lcm(int(cfg.chunk_size), bs)
    return (max(0, limit) // step) * step, step


def mark_first_eviction(st: RequestEvictionState, tokens: int) -> None:
    """The request evicts with ``tokens`` computed: its clean watermark, if it has none
    yet (only its first eviction counts; :meth:`RequestEvictionState.restart` clears it)."""
    # Everything computed so far saw the full context; nothing after this will.
    if st.clean_watermark is None:
        st.clean_watermark = tokens
