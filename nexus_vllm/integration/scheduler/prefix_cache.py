"""Prefix caching with evicting requests: what they publish, and what hit they start from.

Every token an evicting request computes after its first eviction attends to a pruned
context, so its KV must never be offered to another request as a prefix hit: each
request's caching is capped at its *clean watermark* (``RequestEvictionState.
clean_watermark``, set by :func:`mark_first_eviction`), the tokens it had computed when it
first evicted (those saw the full context). The watermark is cleared when the request
restarts (preempted and resumed, possibly from a prefix hit).

The other way round, an evicting request starts from a prefix hit only up to the last
chunk boundary before its first eviction, and before that event's query window
(:func:`prefix_hit_cap`), so it gives the same tokens with prefix caching on or off.
"""

from __future__ import annotations

import math

from nexus_vllm.core import EvictionConfig, cdiv
from nexus_vllm.integration.scheduler.request_state import RequestEvictionState

__all__ = ["mark_first_eviction", "prefix_hit_cap"]


def prefix_hit_cap(cfg: EvictionConfig, prompt_tokens: int,
                   block_size: int) -> tuple[int, int] | None:
    """``(limit, multiple)`` for an evicting request's prefix hit (None: no cap).

    Its prompt is computed in ``chunk_size`` chunks with an event after the first chunk
    that leaves it over its target (:meth:`EvictionConfig.target_blocks`: in ``end`` mode
    without ``prefill_budget`` that is the prompt's last chunk, in ``keep`` mode none). A
    hit must end at a chunk boundary before that event (and on a block boundary), and
    early enough that the event's window, the newest ``prefill_window`` queries, is
    computed in this run (a short last chunk takes rows of the chunk before it), so the
    request evicts exactly as it would with prefix caching off.

    Parameters
    ----------
    cfg : EvictionConfig
        The request's config.
    prompt_tokens : int
    block_size : int
    """
    bs = int(block_size)
    chunk, prompt = int(cfg.chunk_size), int(prompt_tokens)
    step = math.lcm(chunk, bs)
    end = 0
    while end < prompt:
        start, end = end, min(end + chunk, prompt)
        if cdiv(end, bs) > int(cfg.target_blocks(end, prompt)):
            limit = max(0, min(start, end - int(cfg.prefill_window)))
            return (limit // step) * step, step
    return None  # no event during the prompt: any hit is safe


def mark_first_eviction(st: RequestEvictionState, tokens: int) -> None:
    """The request evicts with ``tokens`` computed: its clean watermark, if it has none
    yet (only its first eviction counts; :meth:`RequestEvictionState.restart` clears it)."""
    # Everything computed so far saw the full context; nothing after this will.
    if st.clean_watermark is None:
        st.clean_watermark = tokens
