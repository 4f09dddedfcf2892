"""Block attention mass: how much attention the newest queries put on each KV block.

This is the evidence every eviction policy decides on, and the oracle that the Triton
kernels (``nexus_vllm.kernels``) and the vLLM plugin are tested against. Everything is
computed in float32 whatever the input dtype.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "ATTENTION_REDUCES",
    "KV_LAYOUTS",
    "block_attention_mass",
    "block_attention_mass_paged",
    "cdiv",
    "combine_layer_masses",
    "gather_paged_keys",
    "normalize_rows",
    "num_blocks_for",
]

# How a paged key cache is laid out: ``[num_blocks, block_size, Hkv, D]`` or
# ``[num_blocks, Hkv, block_size, D]``.
KV_LAYOUTS = ("NHD", "HND")
# How the mass of the query heads (and then of the scored layers) becomes one row per
# query: their mean, or their maximum (each row renormalised to sum to 1 by the evidence,
# which keeps its total: ``Evidence.from_gathered``). A block is
# shared by every head and layer, so the choice stays per block; ``max`` lets one head
# that attends to a block sharply (a retrieval head) keep it, where the mean over heads
# that look elsewhere dilutes it (docs/algorithm.md, "Head-aware evidence").
ATTENTION_REDUCES = ("mean", "max")


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints ``b > 0``, exactly (no float rounding for large ``a``)."""
    return -(-a // b)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Number of blocks that hold ``num_tokens`` tokens (the last one may be partial)."""
    return cdiv(num_tokens, block_size)


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def _check_attention_reduce(attention_reduce: str) -> None:
    if attention_reduce not in ATTENTION_REDUCES:
        raise ValueError(f"attention_reduce must be one of {ATTENTION_REDUCES}, got {attention_reduce!r}")


def normalize_rows(mass: torch.Tensor) -> torch.Tensor:
    """``mass`` (Tensor[..., N], non-negative) with each row divided by its sum: the one
    row normalisation of evidence and weights (a vector ``[N]`` is one row). A row of
    zeros (a padded query, a block set nothing attends to) stays zeros, not NaN."""
    sums = mass.sum(dim=-1, keepdim=True)
    return mass / torch.where(sums > 0, sums, torch.ones_like(sums))


def combine_layer_masses(masses: list[torch.Tensor], attention_reduce: str = "mean") -> torch.Tensor:
    """One evidence matrix from the per-layer results of :func:`block_attention_mass`.

    Parameters
    ----------
    masses : list of Tensor[W, N]
        One per scored layer, each reduced over its heads by ``attention_reduce``.
    attention_reduce : {"mean", "max"}
        ``mean``: the mean over layers (rows sum to 1). ``max``: the elementwise maximum
        over layers, as softmax gave it (rows sum to 1 or more;
        :meth:`~nexus_vllm.core.evidence.Evidence.from_gathered` renormalises them and keeps
        their totals).

    Returns
    -------
    Tensor[W, N] (float32): under ``mean`` rows summing to 1 (or 0 for a query that saw
    nothing); under ``max`` rows of maxima.
    """
    _check_attention_reduce(attention_reduce)
    if not masses:
        raise ValueError("combine_layer_masses needs at least one layer")
    stacked = torch.stack([m.float() for m in masses])
    if attention_reduce == "mean":
        return stacked.mean(dim=0)
    return stacked.amax(dim=0)


def block_attention_mass(
    queries: torch.Tensor, keys: torch.Tensor, block_size: int, *, attention_reduce: str = "mean"
) -> torch.Tensor:
    """Attention mass that each window query puts on each block of keys.

    Parameters
    ----------
    queries : Tensor[W, Hq, D]
        The W newest positions of the sequence (post-RoPE). Query ``i`` sits at position
        ``T - W + i`` and attends causally to keys ``0 .. T - W + i``.
    keys : Tensor[T, Hkv, D]
        All cached keys of the sequence, ``Hq % Hkv == 0`` (GQA: query head ``h`` reads KV
        head ``h // (Hq // Hkv)``).
    block_size : int
        Tokens per block; block ``j`` covers tokens ``j*b .. j*b+b-1`` (the last block may
        be partial).
    attention_reduce : {"mean", "max"}
        How the query heads' masses combine (:data:`ATTENTION_REDUCES`).

    Returns
    -------
    Tensor[W, N] (float32)
        ``N = ceil(T / block_size)``. Entry ``[i, j]`` is the softmax mass (scale
        ``1/sqrt(D)``) query ``i`` puts on block ``j``, averaged over query heads (each
        row sums to 1), or with ``max`` the largest over query heads (not renormalised).
    """
    _check_block_size(block_size)
    _check_attention_reduce(attention_reduce)
    if queries.dim() != 3 or keys.dim() != 3:
        raise ValueError(
            f"queries must be [W, Hq, D] and keys [T, Hkv, D], got {tuple(queries.shape)} "
            f"and {tuple(keys.shape)}"
        )
    w, hq, d = queries.shape
    t, hkv, dk = keys.shape
    if dk != d:
        raise ValueError(f"queries and keys must share head size D, got {d} and {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if w > t:
        raise ValueError(f"window W={w} is longer than the sequence T={t}")
    n = num_blocks_for(t, block_size)
    if w == 0:
        return torch.zeros(0, n, dtype=torch.float32, device=queries.device)

    group = hq // hkv
    q = queries.float().permute(1, 0, 2)  # [Hq, W, D]
    k = keys.float().repeat_interleave(group, dim=1).permute(1, 2, 0)  # [Hq, D, T]
    logits = torch.matmul(q, k) * (1.0 / math.sqrt(d))  # [Hq, W, T]
    query_pos = torch.arange(t - w, t, device=queries.device)
    key_pos = torch.arange(t, device=queries.device)
    future = key_pos[None, :] > query_pos[:, None]  # [W, T]
    logits = logits.masked_fill(future, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [Hq, W, T]
    padded = torch.nn.functional.pad(probs, (0, n * block_size - t))
    per_head = padded.view(hq, w, n, block_size).sum(dim=-1)  # [Hq, W, N]
    return per_head.mean(dim=0) if attention_reduce == "mean" else per_head.amax(dim=0)


def gather_paged_keys(
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    *,
    kv_layout: str = "NHD",
) -> torch.Tensor:
    """Gather one sequence's keys from a paged cache into a contiguous ``[T, Hkv, D]``.

    Parameters
    ----------
    key_cache : Tensor[num_blocks, block_size, Hkv, D] (``"NHD"``) or
        Tensor[num_blocks, Hkv, block_size, D] (``"HND"``)
    block_table : Tensor[max_blocks] (int)
        Physical block ids of the sequence in logical order; entries past
        ``ceil(seq_len / block_size)`` are ignored.
    seq_len : int
        Number of live tokens.
    """
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be 4-D, got shape {tuple(key_cache.shape)}")
    block_size = key_cache.shape[1] if kv_layout == "NHD" else key_cache.shape[2]
    n = num_blocks_for(int(seq_len), block_size)
    if n > block_table.numel():
        raise ValueError(
            f"seq_len={seq_len} needs {n} blocks but block_table has {block_table.numel()}"
        )
    ids = block_table[:n].long().to(key_cache.device)
    blocks = key_cache.index_select(0, ids)
    if kv_layout == "HND":
        blocks = blocks.transpose(1, 2)  # -> [n, block_size, Hkv, D]
    return blocks.reshape(n * block_size, *blocks.shape[2:])[: int(seq_len)]


def block_attention_mass_paged(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    *,
    kv_layout: str = "NHD",
    attention_reduce: str = "mean",
) -> torch.Tensor:
    """:func:`block_attention_mass` read from a paged key cache.

    Parameters
    ----------
    queries : Tensor[W, Hq, D]
    key_cache : Tensor[num_blocks, block_size, Hkv, D] (``"NHD"``) or
        Tensor[num_blocks, Hkv, block_size, D] (``"HND"``)
    block_table : Tensor[max_blocks] (int)
        The sequence's physical blocks in logical order.
    seq_len : int
        Live tokens of the sequence.
    attention_reduce : {"mean", "max"}

    Returns
    -------
    Tensor[W, ceil(seq_len / block_size)] (float32), equal to the contiguous version on
    the gathered keys.
    """
    keys = gather_paged_keys(key_cache, block_table, seq_len, kv_layout=kv_layout)
    block_size = key_cache.shape[1] if kv_layout == "NHD" else key_cache.shape[2]
    return block_attention_mass(queries, keys, block_size, attention_reduce=attention_reduce)
