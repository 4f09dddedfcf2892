"""Multi-head latent attention (MLA) on the transformers path, scored as the server
scores it (``nexus_vllm/integration/worker/mla.py``).

transformers' DeepSeek-V2/V3 attention caches the latent, not per-head keys: the cache
layer's ``keys`` hold ``c_kv`` ``[1, 1, T, kv_lora_rank]`` and its ``values`` the rotated
``k_pe`` ``[1, 1, T, qk_rope_head_dim]``, one row per token shared by the heads (evicting
a token drops it from both). The scorer reads them as one KV head of rows ``[c_kv |
k_pe]`` and each query absorbed into the latent: ``q_nope @ W_UK`` (``W_UK`` the key part
of ``kv_b_proj``), then ``q_pe``, times ``scaling * sqrt(D)`` so that its ``1 / sqrt(D)``
softmax is the layer's own; expected attention un-rotates the last ``qk_rope_head_dim``
channels only (:func:`latent_rotary`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol, TypeGuard

import torch

from nexus_vllm.core import Rotary

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["is_mla_attention", "latent_keys", "latent_query", "latent_rotary"]


class MLAAttention(Protocol):
    """What is read of an MLA attention module (transformers' DeepSeek-V2/V3 attention)."""

    kv_b_proj: torch.nn.Linear
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    scaling: float


class KVCacheLayer(Protocol):
    """A transformers cache layer as read here: its key and value rows."""

    keys: torch.Tensor
    values: torch.Tensor


def is_mla_attention(module: object) -> TypeGuard[MLAAttention]:
    """A transformers attention module of the DeepSeek-V2/V3 kind (latent cache)."""
    return all(hasattr(module, name) for name in ("kv_b_proj", "kv_lora_rank",
                                                  "qk_nope_head_dim", "qk_rope_head_dim"))


def latent_query(module: MLAAttention, query: torch.Tensor) -> torch.Tensor:
    """Post-RoPE queries ``[B, N, n, qk_nope + qk_rope]`` of an MLA ``module`` as scaled
    latent queries ``[B, N, n, kv_lora_rank + qk_rope]``."""
    p, lora = int(module.qk_nope_head_dim), int(module.kv_lora_rank)
    heads = query.shape[1]
    w = module.kv_b_proj.weight.view(heads, -1, lora)[:, :p, :]  # [N, P, L]: W_UK per head
    q_nope, q_pe = query[..., :p], query[..., p:]
    ql = torch.einsum("bhnp,hpl->bhnl", q_nope.to(w.dtype), w)
    latent = torch.cat([ql, q_pe.to(ql.dtype)], dim=-1)
    return latent * (float(module.scaling) * math.sqrt(latent.shape[-1]))


def latent_keys(layer: KVCacheLayer) -> torch.Tensor:
    """A cache layer's latent rows ``[T, 1, kv_lora_rank + qk_rope]`` (its ``keys`` then
    its ``values``, batch 0)."""
    return torch.cat([layer.keys[0], layer.values[0]], dim=-1).transpose(0, 1)


def latent_rotary(config: PretrainedConfig, rotary: Rotary) -> Rotary:
    """transformers' DeepSeek rotary table (``qk_rope_head_dim`` wide; it rotates pairs of
    adjacent channels, as complex numbers) acting on latent queries: their last
    ``qk_rope_head_dim`` channels rotate."""
    lora, rope = int(config.kv_lora_rank), int(config.qk_rope_head_dim)
    if rotary.rot_dim != rope:
        raise ValueError(f"the rotary table is {rotary.rot_dim} wide; qk_rope_head_dim is "
                         f"{rope}")
    return Rotary(rotary.cos_sin, neox=False, head_size=lora + rope, offset=lora)
