"""The requests' block lists in vLLM's full-attention manager, as eviction sees them.

A list stays *logical*: an evicted entry is replaced by the pool's shared null block (as
vLLM's sliding-window manager does) and the real block goes back to the pool at once.
Token counts, positions and slot mapping are untouched, so allocation of new blocks keeps
working. The entries that are not the null block are the request's *live* blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nexus_vllm.integration.compat.vllm_compat import BlockPoolView, request_blocks
from nexus_vllm.integration.scheduler.request_state import RequestEvictionState

__all__ = ["LiveBlocks"]


class LiveBlocks:
    """Live entries of each request's block list; nulling and freeing evicted ones.

    Parameters
    ----------
    kv_group : vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager
        The model's one full-attention manager (``vllm_compat.single_type_manager``).
    pool : BlockPoolView
    block_size : int
    """

    def __init__(self, kv_group: Any, pool: BlockPoolView, block_size: int) -> None:
        self.kv_group = kv_group
        self.pool = pool
        self.block_size = int(block_size)

    def of(self, req_id: str) -> list[Any]:
        """The request's block list (``KVCacheBlock`` per logical block; [] if none)."""
        return request_blocks(self.kv_group, req_id)

    def live_indices(self, st: RequestEvictionState,
                     num_blocks: int | None = None) -> Sequence[int]:
        """Logical indices of the request's live blocks (among its first ``num_blocks``
        when given), ascending."""
        blocks = self.of(st.req_id)
        if num_blocks is not None:
            blocks = blocks[:num_blocks]
        return [j for j, b in enumerate(blocks) if not BlockPoolView.is_null(b)]

    def live_count(self, st: RequestEvictionState, num_blocks: int | None = None) -> int:
        return len(self.live_indices(st, num_blocks))

    def evict(self, st: RequestEvictionState, indices: Sequence[int]) -> None:
        """Null these logical entries of the request's list and free their blocks (each
        loses this request's reference; one shared through prefix caching stays with its
        other holders)."""
        blocks = self.of(st.req_id)
        freed = [blocks[j] for j in indices]
        for j in indices:
            blocks[j] = self.pool.null_block
        self.pool.free(freed)
