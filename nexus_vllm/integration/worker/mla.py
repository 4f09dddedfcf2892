"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2): what eviction does
differently on its layers.

An MLA layer caches one latent row per token, ``[c_kv (kv_lora_rank) | k_pe
(qk_rope_head_dim)]`` (576 wide for DeepSeek), shared by every query head: for eviction
it is one KV head of size 576 in a full-attention KV cache group (vLLM's
``MLAAttentionSpec`` subclasses ``FullAttentionSpec``). RoPE is applied at logical
positions before the row is written, so compacted block tables keep their meaning, and
the metadata builder (``MLACommonMetadataBuilder``) is compacted before ``build`` as every
other builder (``backend_mixins.NexusMetadataBuilderMixin``).

Scores need a query against the latent rows. vLLM's ``MLAAttention.forward_impl``
(model_executor/layers/attention/mla_attention.py in 0.32) hands the impl:

* decode tokens, already absorbed, to ``forward_mqa``: ``(q_nope @ W_UK_T, q_pe)``, the
  query whose dot product with a latent row is the attention logit before the scale;
* prompt tokens, un-absorbed (``[T, N, qk_nope + qk_rope]``), to ``forward_mha``, first;
  :func:`absorbed_query` absorbs them the same way (``W_UK_T`` of the layer).

:class:`NexusMLAImplMixin` puts both parts, decode rows first as in the batch, into one
``[tokens, N, 576]`` query and hands it to the query ring, scaled by
``scale * sqrt(576)``: the scorer's softmax uses ``1 / sqrt(D)`` with ``D`` the cached row
size, so the product is MLA's own logit ``scale * q . row`` (``scale`` is
``1 / sqrt(qk_nope + qk_rope)`` for DeepSeek). Evidence that un-rotates queries (expected
attention) un-rotates their last ``qk_rope_head_dim`` channels only
(:func:`latent_rotary`): the absorbed part carries no position.

Backends: ``CPU_MLA`` (vLLM's reference CPU backend: latent size 576 and 16-token blocks
only; the CPU platform turns chunked prefill and prefix caching off for it). The CUDA MLA
backends are not wrapped: the worker refuses them by name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from nexus_vllm.core import Rotary
from nexus_vllm.integration.worker.backend_mixins import NexusAttentionImplMixin

__all__ = ["MLA_BACKENDS", "NexusMLAImplMixin", "absorbed_query", "latent_key_view",
           "latent_rotary", "latent_rows"]

# vLLM MLA backends with eviction support (their KV cache is [num_blocks, block, latent]).
MLA_BACKENDS = ("CPU_MLA",)


def latent_key_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """An MLA layer's cache (``MLAAttention.kv_cache``: ``[num_blocks, block_size,
    latent]``) as the scorer's ``[num_blocks, 1, block_size, latent]`` key view: one
    KV head, every query head reading the same rows."""
    if kv_cache.dim() != 3:
        raise ValueError(f"an MLA KV cache is [num_blocks, block_size, latent]; got shape "
                         f"{tuple(kv_cache.shape)}")
    return kv_cache.unsqueeze(1)


def latent_rows(kv_c_normed: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """The cache rows an MLA layer writes for its tokens, ``[T, 1, latent]``: the
    normalised latent ``[T, kv_lora_rank]`` then the rotated ``k_pe`` (``[T, 1, rope]`` or
    ``[T, rope]``)."""
    pe = k_pe.reshape(k_pe.shape[0], -1)
    return torch.cat([kv_c_normed, pe.to(kv_c_normed.dtype)], dim=-1).unsqueeze(1)


def latent_rotary(rotary: Rotary, latent_size: int) -> Rotary:
    """The layer's rotary table (``qk_rope_head_dim`` wide) acting on latent queries
    ``[kv_lora_rank | qk_rope_head_dim]``: their last channels rotate, the absorbed
    non-rotary part does not (expected attention un-rotates the captured queries)."""
    return dataclasses.replace(rotary, head_size=int(latent_size),
                               offset=int(latent_size) - rotary.rot_dim)


def absorbed_query(q: torch.Tensor, w_uk_t: torch.Tensor, qk_nope_head_dim: int
                   ) -> torch.Tensor:
    """Un-absorbed MLA queries ``[T, N, qk_nope + qk_rope]`` as latent queries
    ``[T, N, kv_lora_rank + qk_rope]``: ``q_nope @ W_UK_T`` (``w_uk_t``: ``[N, qk_nope,
    kv_lora_rank]``, the layer's ``W_UK_T``) then ``q_pe``, as ``forward_impl`` does for
    decode tokens."""
    q_nope, q_pe = q[..., :qk_nope_head_dim], q[..., qk_nope_head_dim:]
    ql_nope = torch.bmm(q_nope.transpose(0, 1).to(w_uk_t.dtype), w_uk_t).transpose(0, 1)
    return torch.cat([ql_nope, q_pe.to(ql_nope.dtype)], dim=-1)


class NexusMLAImplMixin(NexusAttentionImplMixin):
    """The query hook of an MLA impl: the latent queries of every token of the batch to
    the query ring, the written latent rows to the key self-check. Set by the worker:
    ``nexus_ring``, ``nexus_layer``, ``nexus_self_check`` (as every impl) and
    ``nexus_mla_layer``, the ``MLAAttention`` module owning the impl (its ``W_UK_T``)."""

    nexus_mla_layer: Any = None
    # The prompt tokens' latent queries of this layer's current forward, waiting for the
    # decode tokens' (forward_impl calls forward_mha first, then forward_mqa).
    _nexus_prefill_q: torch.Tensor | None = None

    def _nexus_wanted(self) -> bool:
        ring = self.nexus_ring
        return (ring is not None and ring.step_capture is not None
                and self.nexus_layer in ring.ring_layer)

    def _nexus_scale(self, q: torch.Tensor) -> torch.Tensor:
        # The scorer divides by sqrt(D); this makes its logit MLA's scale * q . row.
        scale = float(getattr(self, "scale", 1.0 / math.sqrt(q.shape[-1])))
        return q * (scale * math.sqrt(q.shape[-1]))

    def forward_mha(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: Any,
                    *args: Any, **kwargs: Any) -> Any:
        self._nexus_prefill_q = None
        if self._nexus_wanted():
            layer = self.nexus_mla_layer
            latent = self._nexus_scale(absorbed_query(
                q, layer.W_UK_T, int(self.qk_nope_head_dim)))  # type: ignore[attr-defined]
            if int(attn_metadata.num_decode_tokens or 0) == 0:
                self._nexus_capture(latent)
            else:
                self._nexus_prefill_q = latent
        return super().forward_mha(  # type: ignore[misc]
            q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, *args, **kwargs)

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: Any,
                    *args: Any, **kwargs: Any) -> Any:
        prefill, self._nexus_prefill_q = self._nexus_prefill_q, None
        if self._nexus_wanted():
            latent = torch.cat(q, dim=-1) if isinstance(q, tuple) else q
            latent = self._nexus_scale(latent)
            self._nexus_capture(latent if prefill is None
                                else torch.cat([latent, prefill.to(latent.dtype)], dim=0))
        return super().forward_mqa(  # type: ignore[misc]
            q, kv_c_and_k_pe_cache, attn_metadata, *args, **kwargs)

    def _nexus_capture(self, latent: torch.Tensor) -> None:
        ring = self.nexus_ring
        assert ring is not None
        ring.capture(self.nexus_layer, latent)

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                           kv_cache: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        super().do_kv_cache_update(  # type: ignore[misc]
            kv_c_normed, k_pe, kv_cache, *args, **kwargs)
        ring = self.nexus_ring
        if ring is not None and self.nexus_self_check:
            ring.check_keys(self.nexus_layer, latent_rows(kv_c_normed, k_pe))
