"""The two mixins a nexus attention backend adds to vLLM's own classes
(:func:`~nexus_vllm.integration.worker.attention.nexus_backend` builds the backends):

* :class:`NexusMetadataBuilderMixin` hands the ``CommonAttentionMetadata`` to the
  worker's compactor (``compaction.py``) before the stock ``build``;
* :class:`NexusAttentionImplMixin` hands the newest queries of tracked requests to the
  worker's query ring (``query_ring.py``) before the stock ``forward``; the MLA impl's
  hook (``mla.NexusMLAImplMixin``) extends it.

A module of their own, below both ``attention.py`` and ``mla.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from nexus_vllm.integration.worker.compaction import Compactor
    from nexus_vllm.integration.worker.query_ring import QueryRing

__all__ = ["NexusAttentionImplMixin", "NexusMetadataBuilderMixin"]


class NexusMetadataBuilderMixin:
    """Compacts evicted blocks out of the metadata before the stock ``build``."""

    # Always build (never patch a cached build's block table): compaction runs in build.
    supports_update_block_table = False
    nexus_compactor: Compactor | None = None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              *args: Any, **kwargs: Any) -> object:
        compactor = self.nexus_compactor
        if compactor is not None:
            common_attn_metadata = compactor.compact(common_attn_metadata)
        return super().build(common_prefix_len, common_attn_metadata, *args,  # type: ignore[misc]
                             **kwargs)


class NexusAttentionImplMixin:
    """Copies the newest queries of tracked requests before the stock ``forward``."""

    nexus_ring: QueryRing | None = None
    nexus_layer: int = -1
    nexus_self_check: bool = False

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: object,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        ring = self.nexus_ring
        if ring is not None and attn_metadata is not None:
            ring.capture(self.nexus_layer, query)
        out = super().forward(layer, query, key, value, kv_cache,  # type: ignore[misc]
                              attn_metadata, *args, **kwargs)
        if ring is not None and self.nexus_self_check and attn_metadata is not None:
            ring.check_keys(self.nexus_layer, key)
        return out
