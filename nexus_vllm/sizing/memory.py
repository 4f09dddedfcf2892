"""KV blocks per GPU, by vLLM's rule.

The memory vLLM may use (``gpu_memory x gpu_util``) less this GPU's share of the weights
(``weights / (tp x pp)``) less an allowance for activations, CUDA graphs and non-torch
memory (``--overhead-gib``, 4 GiB by default: vLLM profiles it at start-up; for an
8k-token step on 8B-72B models it is a few GiB), divided by the bytes of one block on one
GPU::

    2 (K and V) x ceil(layers / pp) x ceil(kv_heads / tp) x head_size x dtype_bytes x block_size

(KV heads are replicated when ``tp > kv_heads``; the largest pipeline stage sets the
count). A multi-head latent attention (MLA) model caches one latent row per token per layer
instead, K only and whole on every TP rank (vLLM's ``MLAAttentionSpec``: one KV head,
``max_tp_shards=1``, no V)::

    ceil(layers / pp) x (kv_lora_rank + qk_rope_head_dim) x dtype_bytes x block_size
"""

from __future__ import annotations

import math
from typing import TypedDict

from nexus_vllm.core import cdiv

from .groups import kv_cache_groups, layers_per_block
from .shape import ModelShape

__all__ = ["GIB", "PoolMemory", "block_bytes_per_gpu", "kv_pool_blocks", "page_bytes_per_layer"]

GIB = 2**30


def page_bytes_per_layer(model: ModelShape, *, tp: int, block_size: int) -> int:
    """Bytes of one layer's page of one block on one GPU (vLLM's ``page_size_bytes``):
    ``2 x ceil(kv_heads / tp) x head_size x dtype_bytes x block_size``; for MLA, the
    latent row alone, not split by TP: ``head_size x dtype_bytes x block_size``."""
    if model.mla:
        return model.head_size * model.dtype_bytes * block_size
    return 2 * cdiv(model.kv_heads, tp) * model.head_size * model.dtype_bytes * block_size


def block_bytes_per_gpu(model: ModelShape, *, tp: int, pp: int, block_size: int) -> int:
    """Bytes one KV block takes on one GPU: a layer's page (:func:`page_bytes_per_layer`)
    times the layers a block spans (:func:`.groups.layers_per_block`; ``ceil(layers /
    pp)`` for a model with one KV cache group)."""
    return (page_bytes_per_layer(model, tp=tp, block_size=block_size)
            * layers_per_block(kv_cache_groups(model), model.layers, pp))


class PoolMemory(TypedDict):
    """:func:`kv_pool_blocks`: one GPU's memory arithmetic, bytes (``pool_blocks``: the
    KV blocks it holds)."""

    usable_memory_bytes: float
    weight_bytes_per_gpu: float
    overhead_bytes: float
    kv_bytes_per_gpu: float
    layers_per_block: int
    block_bytes_per_gpu: int
    pool_blocks: int


def kv_pool_blocks(model: ModelShape, *, gpu_memory_gib: float, gpu_util: float,
                   overhead_gib: float, tp: int, pp: int, block_size: int) -> PoolMemory:
    """vLLM's block count per GPU (the pool of one replica), with the arithmetic."""
    budget = gpu_memory_gib * GIB * gpu_util
    weights = model.weight_bytes / (tp * pp)
    kv_bytes = budget - weights - overhead_gib * GIB
    per_block = block_bytes_per_gpu(model, tp=tp, pp=pp, block_size=block_size)
    return {"usable_memory_bytes": budget, "weight_bytes_per_gpu": weights,
            "overhead_bytes": overhead_gib * GIB, "kv_bytes_per_gpu": kv_bytes,
            "layers_per_block": layers_per_block(kv_cache_groups(model), model.layers, pp),
            "block_bytes_per_gpu": per_block,
            "pool_blocks": max(0, math.floor(kv_bytes / per_block))}

