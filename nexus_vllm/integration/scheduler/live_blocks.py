"""The requests' block lists in vLLM's full-attention manager, as eviction sees them.

A list stays *logical*: an evicted entry is replaced by the pool's shared null block (as
vLLM's sliding-window manager does) and the real block goes back to the pool at once.
Token counts, positions and slot mapping are untouched, so allocation of new blocks keeps
working. The entries that are not the null block are the request's *live* blocks.

The live blocks are kept per request (its state's ``LiveIndex``) rather than found by
reading the list: only eviction nulls an entry, so an entry read once stays as read until
it is evicted here, and each step reads only the entries vLLM appended since the last
one. A step's work then follows the requests scheduled and the blocks evicted, not the
sequence length (a 32k-token request holds 2048 logical entries of 16 tokens, most of
them null; ``benchmarks/scheduler/schedule_overhead.py``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from nexus_vllm.core.budget import window_blocks, window_in_flight_tokens
from nexus_vllm.core.config import EvictionConfig
from nexus_vllm.integration.compat.vllm_compat import BlockPoolView, WindowGroup, request_blocks
from nexus_vllm.integration.compat.vllm_types import KVBlock
from nexus_vllm.integration.scheduler.request_state import LiveIndex, RequestEvictionState

if TYPE_CHECKING:
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

__all__ = ["LiveBlocks", "PoolPeaks", "WindowBlocks"]


class LiveBlocks:
    """Live entries of each request's block list; nulling and freeing evicted ones.

    Parameters
    ----------
    kv_group : vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager
        The model's full-attention manager (``vllm_compat.kv_cache_groups``).
    pool : BlockPoolView
    block_size : int
    """

    def __init__(self, kv_group: SingleTypeKVCacheManager, pool: BlockPoolView,
                 block_size: int) -> None:
        self.kv_group = kv_group
        self.pool = pool
        self.block_size = int(block_size)

    def of(self, req_id: str) -> list[KVBlock]:
        """The request's block list (``KVCacheBlock`` per logical block; [] if none)."""
        return request_blocks(self.kv_group, req_id)

    def _index(self, st: RequestEvictionState) -> LiveIndex:
        """``st.live`` brought up to date: the entries vLLM appended since the last call
        are read; a new list (the request restarted) or a shorter one is read anew."""
        blocks = self.of(st.req_id)
        index = st.live
        if index.blocks is not blocks or len(blocks) < index.seen:
            index.blocks, index.live, index.seen = blocks, [], 0
        if len(blocks) > index.seen:
            index.live.extend(j for j in range(index.seen, len(blocks))
                              if not BlockPoolView.is_null(blocks[j]))
            index.seen = len(blocks)
        return index

    def live_indices(self, st: RequestEvictionState,
                     num_blocks: int | None = None) -> Sequence[int]:
        """Logical indices of the request's live blocks (among its first ``num_blocks``
        when given), ascending; read-only, valid until the next call for the request."""
        index = self._index(st)
        if num_blocks is not None and num_blocks < index.seen:
            return index.live[:bisect_left(index.live, num_blocks)]
        return index.live

    def live_count(self, st: RequestEvictionState, num_blocks: int | None = None) -> int:
        """How many live blocks the request holds (among its first ``num_blocks``)."""
        index = self._index(st)
        if num_blocks is not None and num_blocks < index.seen:
            return bisect_left(index.live, num_blocks)
        return len(index.live)

    def evict(self, st: RequestEvictionState, indices: Sequence[int]) -> None:
        """Null these logical entries of the request's list and free their blocks (each
        loses this request's reference; one shared through prefix caching stays with its
        other holders)."""
        index = self._index(st)
        blocks = index.blocks
        assert blocks is not None
        freed = [blocks[j] for j in indices]
        for j in indices:
            blocks[j] = self.pool.null_block
        self.pool.free(freed)
        gone = set(indices)
        # A new list, not an edit in place: a caller may still hold the old one.
        index.live = [j for j in index.live if j not in gone]


class WindowBlocks:
    """The blocks a request holds in sliding-window groups (vLLM's to free, never
    evicted), counted so that admission reserves them too.

    Parameters
    ----------
    groups : sequence of WindowGroup
        The model's sliding-window groups (none for a full-attention model).
    step_tokens : int
        Most tokens one request computes in a step (vLLM's token budget per step).
    steps_in_flight : int
        k, the steps vLLM schedules before the first one's output is processed
        (``max_concurrent_batches``).
    server_cfg : EvictionConfig, optional
        The server's config: where it evicts mid-prompt, every request's prompt step is
        capped at its ``chunk_size`` (the scheduler's per-request cap), and so is each
        prompt step in flight.
    """

    def __init__(self, groups: Sequence[WindowGroup], step_tokens: int,
                 steps_in_flight: int = 1, server_cfg: EvictionConfig | None = None) -> None:
        self.groups = tuple(groups)
        self.step_tokens = int(step_tokens)
        self.steps_in_flight = max(1, int(steps_in_flight))
        self.server_cfg = server_cfg

    def allowance(self, total_tokens: int, tokens: int = 0,
                  prefill_end: int | None = None) -> int:
        """Most blocks a request of ``total_tokens`` may still hold across the window
        groups once ``tokens`` are computed (as of its last scheduled step), with
        ``prefill_end`` its prompt or what it recomputes (None: a request yet to start):
        in each group the window plus the tokens in flight, k steps while it computes
        its prompt (each of at most ``step_tokens``, or the server's ``chunk_size`` where
        it caps prompt steps) and k tokens once it decodes, never more than its sequence
        (:func:`~nexus_vllm.core.budget.window_in_flight_tokens`,
        :func:`~nexus_vllm.core.budget.window_blocks`)."""
        in_flight = window_in_flight_tokens(self.step_tokens, self.steps_in_flight,
                                            tokens=tokens, prefill_end=prefill_end,
                                            server_cfg=self.server_cfg)
        return sum(window_blocks(g.window, g.block_size, total_tokens, in_flight)
                   for g in self.groups)

    def held(self, req_id: str) -> int:
        """Blocks the request holds in the window groups now: the entries after the last
        null (vLLM nulls everything below the window, oldest first)."""
        count = 0
        for g in self.groups:
            for block in reversed(request_blocks(g.manager, req_id)):
                if BlockPoolView.is_null(block):
                    break
                count += 1
        return count


class PoolPeaks:
    """The most blocks each request has held in vLLM's block pool, counted in vLLM's own
    block lists: a self-check of the bounds that does not trust the live index.

    :meth:`held` reads the whole list (every entry that is not the null block, those past
    the computed tokens included) rather than :class:`LiveBlocks`'s index, so it costs the
    list's length per request: a debug check. Read at the end of vLLM's ``schedule()``:
    vLLM allocates a step's blocks only there and eviction only frees, so the largest
    count read is the most the request ever held.

    Parameters
    ----------
    blocks : LiveBlocks
        Whose block lists (vLLM's full-attention manager) are read.
    """

    def __init__(self, blocks: LiveBlocks) -> None:
        self.blocks = blocks
        # Request -> (its peak so far, its bound): requests not forgotten yet.
        self.peaks: dict[str, tuple[int, int]] = {}
        # High-water marks over every request read: the most blocks one request held, and
        # the most one held above its bound (None: nothing read yet).
        self.peak = 0
        self.over_bound: int | None = None

    def held(self, req_id: str) -> int:
        """Blocks the request holds in vLLM's pool now (non-null entries of its list)."""
        return sum(1 for b in self.blocks.of(req_id) if not BlockPoolView.is_null(b))

    def observe(self, req_id: str, bound: int) -> int:
        """Read the request's blocks against ``bound``; returns what it holds now."""
        held = self.held(req_id)
        peak = max(held, self.peaks.get(req_id, (0, 0))[0])
        self.peaks[req_id] = (peak, int(bound))
        self.peak = max(self.peak, held)
        excess = held - int(bound)
        self.over_bound = excess if self.over_bound is None else max(self.over_bound, excess)
        return held

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the peaks of requests that are gone (the high-water marks stay)."""
        for req_id in req_ids:
            self.peaks.pop(req_id, None)
