"""Typed launchers of the scoring kernels, registered as torch custom ops.

``block_attention_mass_paged`` and ``block_attention_mass_paged_layers`` (exported by
``nexus_vllm.kernels.ops``, whose docstring has the contracts), their argument checks, and
the custom ops ``torch.ops.nexus_vllm.block_attention_mass_paged`` and
``block_attention_mass_paged_add_`` that dispatch to the Triton launches (``_launch.py``)
or the torch paths (``_reference.py``).
This module has no ``from __future__ import annotations``: ``torch.library.custom_op``
infers the schemas from real annotations.
"""

from collections.abc import Sequence

import torch

from nexus_vllm.core.scoring import ATTENTION_REDUCES, KV_LAYOUTS
from nexus_vllm.kernels._common import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_backend,
    check_same_device,
    resolve_backend,
)
from nexus_vllm.kernels._launch import block_mass_triton
from nexus_vllm.kernels._reference import (
    block_attention_mass_paged_batched,
    block_attention_mass_paged_batched_layers,
    block_attention_mass_paged_torch,
    block_size_of,
    paged_dims,
)
from nexus_vllm.kernels._tuning import scoring_block_size_ok

__all__ = ["block_attention_mass_paged", "block_attention_mass_paged_layers"]


def block_attention_mass_paged(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    backend: str = "auto",
    out: torch.Tensor | None = None,
    attention_reduce: str = "mean",
) -> torch.Tensor:
    """Attention mass of each request's window queries on each of its live KV blocks.

    Parameters
    ----------
    queries : Tensor[R, W, Hq, D] (float32, float16 or bfloat16)
        The W newest queries of each request (post-RoPE); query ``i`` sits at live
        position ``seq_lens[r] - W + i``.
    key_cache : Tensor[num_blocks, block_size, Hkv, D] (``"NHD"``) or
        Tensor[num_blocks, Hkv, block_size, D] (``"HND"``)
        The K part of a paged cache; any strides (e.g. a view of a fused K/V cache).
    block_tables : Tensor[R, max_blocks] (int32 or int64)
        Live (compacted) physical block ids of each request in logical order.
    seq_lens : Tensor[R] (int32 or int64)
        Live tokens per request; entries of ``block_tables`` past
        ``ceil(seq_len / block_size)`` are ignored.
    kv_layout : {"NHD", "HND"}
    backend : {"auto", "triton", "torch", "batched"}
    out : Tensor[R, W, max_blocks] (float32), optional
        If given, the result is combined into it (several layers into one buffer): added,
        or with ``attention_reduce="max"`` the elementwise maximum.
    attention_reduce : {"mean", "max"}
        How the query heads combine (``nexus_vllm.core.ATTENTION_REDUCES``).

    Returns
    -------
    Tensor[R, W, max_blocks] (float32)
        ``[r, i, j]``: mass query ``i`` of request ``r`` puts on its ``j``-th block,
        averaged over query heads (rows sum to 1), or their maximum; rows at negative
        positions (requests shorter than ``W``) are 0; columns past the request's block
        count are 0 (or unchanged in ``out``).
    """
    _check_mass_args(queries, key_cache, block_tables, seq_lens, kv_layout, backend, out,
                     attention_reduce)
    if out is None:
        return torch.ops.nexus_vllm.block_attention_mass_paged(
            queries, key_cache, block_tables, seq_lens, kv_layout, backend, attention_reduce
        )
    torch.ops.nexus_vllm.block_attention_mass_paged_add_(
        queries, key_cache, block_tables, seq_lens, out, kv_layout, backend, attention_reduce
    )
    return out


def block_attention_mass_paged_layers(
    queries: torch.Tensor,
    key_caches: Sequence[torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    backend: str = "auto",
    out: torch.Tensor | None = None,
    attention_reduce: str = "mean",
) -> torch.Tensor:
    """:func:`block_attention_mass_paged` over several layers of one batch, summed (with
    ``attention_reduce="max"``: the maximum over every layer and head).

    Parameters
    ----------
    queries : Tensor[L, R, W, Hq, D]
        Layer ``l``'s window queries, scored against ``key_caches[l]``.
    key_caches : sequence of L key caches
        Same shapes, dtype and layout as the single-layer op takes.
    block_tables, seq_lens, kv_layout, backend, out, attention_reduce
        As for :func:`block_attention_mass_paged`; shared by every layer.

    Returns
    -------
    Tensor[R, W, max_blocks] (float32)
        The sum over layers of the single-layer result (or their maximum), combined into
        ``out`` if given.
        The ``"batched"`` backend builds what depends only on the batch (gather ids,
        positions, the mask) once for all layers; the others run one launch per layer.
    """
    if queries.dim() != 5 or queries.shape[0] != len(key_caches):
        raise ValueError(f"queries must be [L={len(key_caches)}, R, W, Hq, D], got shape "
                         f"{tuple(queries.shape)}")
    # The shared arguments once; then only what can differ per layer (on the hot path).
    _check_mass_args(queries[0], key_caches[0], block_tables, seq_lens, kv_layout, backend, out,
                     attention_reduce)
    first = key_caches[0]
    for li, cache in enumerate(key_caches):
        if (cache.shape != first.shape or cache.dtype != first.dtype
                or cache.device != first.device):
            raise ValueError(
                f"key_caches[{li}] is {tuple(cache.shape)} {cache.dtype} on {cache.device}; "
                f"every layer must match key_caches[0]: {tuple(first.shape)} {first.dtype} "
                f"on {first.device}")
    if out is None:
        out = torch.zeros(
            _mass_out_shape(queries, block_tables), dtype=torch.float32, device=queries.device
        )
    if resolve_backend(backend, queries.device) == "batched":
        block_attention_mass_paged_batched_layers(
            queries, key_caches, block_tables, seq_lens, out, kv_layout, attention_reduce
        )
        return out
    for q, cache in zip(queries, key_caches, strict=True):
        torch.ops.nexus_vllm.block_attention_mass_paged_add_(
            q, cache, block_tables, seq_lens, out, kv_layout, backend, attention_reduce
        )
    return out


# --------------------------------------------------------------------------------------
# Argument checks (shapes/dtypes only: they must also work on fake tensors).
# --------------------------------------------------------------------------------------


def _check_mass_args(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_layout: str,
    backend: str,
    out: torch.Tensor | None,
    attention_reduce: str = "mean",
) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    if attention_reduce not in ATTENTION_REDUCES:
        raise ValueError(f"attention_reduce must be one of {ATTENTION_REDUCES}, got {attention_reduce!r}")
    check_backend(backend)
    if queries.dim() != 4:
        raise ValueError(f"queries must be [R, W, Hq, D], got shape {tuple(queries.shape)}")
    if queries.dtype not in FLOAT_DTYPES:
        raise ValueError(f"queries must be float32/float16/bfloat16, got {queries.dtype}")
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be 4-D, got shape {tuple(key_cache.shape)}")
    if key_cache.dtype != queries.dtype:
        raise ValueError(
            f"key_cache dtype {key_cache.dtype} must match queries dtype {queries.dtype}"
        )
    r, _, hq, d = queries.shape
    _, hkv = paged_dims(key_cache, kv_layout)
    if key_cache.shape[3] != d:
        raise ValueError(f"key_cache head size {key_cache.shape[3]} != queries head size {d}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key_cache KV heads ({hkv})")
    if block_tables.dim() != 2 or block_tables.shape[0] != r:
        raise ValueError(
            f"block_tables must be [R={r}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if block_tables.dtype not in INT_DTYPES:
        raise ValueError(f"block_tables must be int32/int64, got {block_tables.dtype}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != r:
        raise ValueError(f"seq_lens must be [R={r}], got {tuple(seq_lens.shape)}")
    if seq_lens.dtype not in INT_DTYPES:
        raise ValueError(f"seq_lens must be int32/int64, got {seq_lens.dtype}")
    check_same_device(
        "queries", queries,
        ("key_cache", key_cache), ("block_tables", block_tables), ("seq_lens", seq_lens),
    )
    if out is not None:
        want = _mass_out_shape(queries, block_tables)
        if tuple(out.shape) != want or out.dtype != torch.float32:
            raise ValueError(f"out must be float32 {want}, got {out.dtype} {tuple(out.shape)}")
        check_same_device("queries", queries, ("out", out))


def _mass_out_shape(queries: torch.Tensor, block_tables: torch.Tensor) -> tuple[int, int, int]:
    """``(R, W, max_blocks)``, the result's shape, for ``queries`` ``[(L,) R, W, Hq, D]``."""
    return queries.shape[-4], queries.shape[-3], block_tables.shape[1]


# --------------------------------------------------------------------------------------
# Custom ops (what torch.compile sees) and their fake implementations.
# --------------------------------------------------------------------------------------


def _mass_impl(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_layout: str,
    backend: str,
    accumulate: bool,
    attention_reduce: str,
) -> None:
    which = resolve_backend(backend, queries.device)
    # "auto" takes the kernel only for the block sizes it supports; "triton" lets the
    # launch refuse the others.
    if which == "triton" and (
        scoring_block_size_ok(block_size_of(key_cache, kv_layout)) or backend == "triton"
    ):
        block_mass_triton(
            queries, key_cache, block_tables, seq_lens, out, kv_layout, accumulate,
            attention_reduce == "max",
        )
        return
    # The torch paths (torch also for "auto" with a block size the kernel does not take)
    # combine into out; mass is >= 0, so a zeroed out is the identity of both the sum and
    # the maximum.
    if not accumulate:
        out.zero_()
    torch_path = (
        block_attention_mass_paged_batched if which == "batched"
        else block_attention_mass_paged_torch
    )
    torch_path(queries, key_cache, block_tables, seq_lens, out, kv_layout, attention_reduce)


@torch.library.custom_op("nexus_vllm::block_attention_mass_paged", mutates_args=())
def _block_mass_op(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_layout: str,
    backend: str,
    attention_reduce: str,
) -> torch.Tensor:
    out = torch.empty(
        _mass_out_shape(queries, block_tables), dtype=torch.float32, device=queries.device
    )
    _mass_impl(queries, key_cache, block_tables, seq_lens, out, kv_layout, backend, False,
               attention_reduce)
    return out


@_block_mass_op.register_fake
def _(queries, key_cache, block_tables, seq_lens, kv_layout, backend, attention_reduce):
    return queries.new_empty(_mass_out_shape(queries, block_tables), dtype=torch.float32)


@torch.library.custom_op("nexus_vllm::block_attention_mass_paged_add_", mutates_args=("out",))
def _block_mass_add_op(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_layout: str,
    backend: str,
    attention_reduce: str,
) -> None:
    _mass_impl(queries, key_cache, block_tables, seq_lens, out, kv_layout, backend, True,
               attention_reduce)


@_block_mass_add_op.register_fake
def _(queries, key_cache, block_tables, seq_lens, out, kv_layout, backend, attention_reduce):
    return None
