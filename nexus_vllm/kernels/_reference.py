"""Torch paths of the kernels: the reference, and what runs without Triton.

``block_attention_mass_paged_torch`` is ``nexus_vllm.core.block_attention_mass_paged`` per
request (the definition the kernels are tested against); ``block_attention_mass_paged_batched``
is the same math vectorised over requests (the vLLM plugin's CPU scorer);
``compact_block_tables_torch`` is the compaction in a handful of tensor ops. Arguments are
checked by the public launchers (``_scoring_ops.py``, ``_compaction_ops.py``); here only
values are (``seq_lens``).
Pure torch: no triton import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from nexus_vllm.core.scoring import block_attention_mass_paged as _core_mass_paged
from nexus_vllm.core.scoring import num_blocks_for


def paged_dims(key_cache: torch.Tensor, kv_layout: str) -> tuple[int, int]:
    """``(block_size, kv_heads)`` of a ``"NHD"`` or ``"HND"`` key cache (its shape entries:
    symbolic under ``torch.compile``)."""
    if kv_layout == "NHD":
        return key_cache.shape[1], key_cache.shape[2]
    return key_cache.shape[2], key_cache.shape[1]


def block_size_of(key_cache: torch.Tensor, kv_layout: str) -> int:
    """Tokens per block of a ``"NHD"`` or ``"HND"`` key cache."""
    return int(paged_dims(key_cache, kv_layout)[0])


def _combine_into(view: torch.Tensor, mass: torch.Tensor, attention_reduce: str) -> None:
    """Combine ``mass`` into ``view`` in place: added, or with ``attention_reduce="max"``
    the elementwise maximum (mass is >= 0, so a zeroed ``view`` is the identity of both)."""
    if attention_reduce == "max":
        torch.maximum(view, mass, out=view)
    else:
        view += mass


def block_attention_mass_paged_torch(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_layout: str = "NHD",
    attention_reduce: str = "mean",
) -> torch.Tensor:
    """Torch fallback: ``core.block_attention_mass_paged`` per request, combined into
    ``out`` (added; with ``attention_reduce="max"`` the elementwise maximum).

    ``out`` is float32 ``[R, W, max_blocks]``; rows of requests shorter than the window and
    columns past each request's block count are left unchanged.
    """
    w = queries.shape[1]
    max_blocks = block_tables.shape[1]
    block_size = block_size_of(key_cache, kv_layout)
    for r, seq_len in enumerate(seq_lens.tolist()):
        if seq_len < 0:
            raise ValueError(f"seq_lens[{r}] = {seq_len} is negative")
        n = num_blocks_for(seq_len, block_size)
        if n > max_blocks:
            raise ValueError(
                f"seq_lens[{r}] = {seq_len} needs {n} blocks but block_tables has {max_blocks}"
            )
        w_live = min(w, seq_len)
        if w_live == 0:
            continue
        mass = _core_mass_paged(
            queries[r, w - w_live :], key_cache, block_tables[r], seq_len, kv_layout=kv_layout,
            attention_reduce=attention_reduce,
        )
        _combine_into(out[r, w - w_live :, :n], mass, attention_reduce)
    return out


# Scratch budget of the batched path (float32 logits per chunk of requests): bounds its
# memory whatever the batch. 2 MiB chunks measured faster on CPU than 64 MiB ones
# (benchmarks/kernels/cpu_scoring.py): the softmax stays in cache.
_BATCHED_LOGITS = 1 << 19


# Mask value: finite, so a fully masked row gives a (discarded) uniform row instead of NaN.
_MASKED = -1.0e30


def _first_masked_column(lens: torch.Tensor, w: int, block_size: int, width: int) -> int:
    """Block-aligned column before which no query row of ``lens`` has a hidden key.

    Query ``i`` of a request sits at ``len - w + i`` and sees keys up to there, so every
    key below ``min(lens) - w + 1`` is visible to all rows. The start is read from
    ``lens`` on CPU only (free there); elsewhere it is 0: nothing is read back.
    """
    if lens.device.type != "cpu":
        return 0
    return min(max(0, int(lens.min()) - w + 1) // block_size * block_size, width)


def block_attention_mass_paged_batched(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_layout: str = "NHD",
    attention_reduce: str = "mean",
) -> torch.Tensor:
    """The torch path vectorised over requests: combined into ``out`` like the others."""
    return block_attention_mass_paged_batched_layers(
        queries[None], [key_cache], block_tables, seq_lens, out, kv_layout, attention_reduce
    )


def block_attention_mass_paged_batched_layers(
    queries: torch.Tensor,
    key_caches: Sequence[torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_layout: str = "NHD",
    attention_reduce: str = "mean",
) -> torch.Tensor:
    """The batched path over several layers: ``queries[l]`` against ``key_caches[l]``,
    all combined into ``out`` (float32 ``[R, W, max_blocks]``): each layer's mean over
    its query heads summed, or with ``attention_reduce="max"`` the maximum over every layer
    and head (and ``out``).

    What depends only on the batch (gather ids, query positions, the mask) is built once
    per chunk of requests, then each layer costs a gather, one ``bmm``, a masked tail, a
    softmax and the per-block sums. All requests' keys are gathered through their whole
    block-table rows; keys past a request's length (garbage entries past its blocks
    included) and future keys are masked, but only from the first column any row may not
    see (``_first_masked_column``), so the mask touches a sliver of the logits.
    """
    layers, r, w, hq, d = queries.shape
    m = block_tables.shape[1]
    if layers == 0 or r == 0 or w == 0 or m == 0:
        return out
    nb = key_caches[0].shape[0]
    bs, hkv = paged_dims(key_caches[0], kv_layout)
    g, t = hq // hkv, m * bs
    dev = queries.device
    # The softmax scale is folded into the (small) queries instead of the logits.
    scale = 1.0 / math.sqrt(d)
    step = max(1, _BATCHED_LOGITS // max(1, hq * w * t))
    for lo in range(0, r, step):
        hi = min(r, lo + step)
        n = hi - lo
        lens = seq_lens[lo:hi].long()
        pos = lens[:, None] - w + torch.arange(w, device=dev)  # [n, W] query positions
        first = _first_masked_column(lens, w, bs, t)
        key_pos = torch.arange(first, t, device=dev)
        # [n, 1, 1, W, t - first]: broadcast over KV heads and the query heads of each.
        hidden = (key_pos[None, None, :] > pos[:, :, None])[:, None, None]
        # Rows at negative positions (a request shorter than the window) are dropped.
        live_rows = (pos >= 0)[:, :, None].float()
        ids = block_tables[lo:hi].long().clamp(0, nb - 1).reshape(-1)
        for q_layer, cache in zip(queries, key_caches, strict=True):
            blocks = cache.index_select(0, ids)
            if kv_layout == "NHD":  # [n * M, bs, Hkv, D] -> [n, Hkv, M, bs, D]
                keys = blocks.view(n, m, bs, hkv, d).permute(0, 3, 1, 2, 4)
            else:  # [n * M, Hkv, bs, D]
                keys = blocks.view(n, m, hkv, bs, d).permute(0, 2, 1, 3, 4)
            keys = keys.reshape(n * hkv, t, d).float()
            # Query heads grouped by KV head: [n * Hkv, G * W, D], rows g-major.
            q = (q_layer[lo:hi].float() * scale).view(n, w, hkv, g, d).permute(0, 2, 3, 1, 4)
            logits = torch.bmm(q.reshape(n * hkv, g * w, d), keys.transpose(1, 2))
            if first < t:
                # A finite floor keeps fully masked rows NaN-free (they are dropped).
                logits.view(n, hkv, g, w, t)[..., first:].masked_fill_(hidden, _MASKED)
            per_head = torch.softmax(logits, dim=-1).view(n, hq, w, m, bs).sum(dim=-1)
            heads = per_head.amax(dim=1) if attention_reduce == "max" else per_head.mean(dim=1)
            _combine_into(out[lo:hi], heads * live_rows, attention_reduce)
    return out


def compact_block_tables_torch(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    null_block: int,
    out_tables: torch.Tensor,
    out_seq_lens: torch.Tensor,
    validate: bool = True,
) -> None:
    """Vectorised torch compaction (a handful of ops, no Python loop over requests).

    With ``validate`` it checks the lengths fit the table (one host read) and touches
    only the columns that hold live blocks (``max(ceil(seq_len / block_size))``);
    without, it reads nothing back (the vLLM plugin's per-step path) and, like the Triton
    kernel, clamps each row's block count to the table.
    """
    r, max_blocks = block_tables.shape
    if r == 0:
        return
    seq = seq_lens.to(torch.int64)
    n = torch.div(seq + (block_size - 1), block_size, rounding_mode="floor")
    if validate:
        n_max, seq_min = (int(v) for v in torch.stack([n.max(), seq.min()]).tolist())
        if n_max > max_blocks or seq_min < 0:
            bad = int(torch.nonzero((n > max_blocks) | (seq < 0))[0, 0])
            raise ValueError(
                f"seq_lens[{bad}] = {int(seq[bad])} does not fit a block table of "
                f"{max_blocks} blocks of {block_size} tokens"
            )
    else:
        n = n.clamp_(0, max_blocks)
        n_max = max_blocks
    if n_max < max_blocks:
        out_tables[:, n_max:].fill_(null_block)
    if n_max == 0:
        out_seq_lens.copy_(seq_lens)
        return
    table = block_tables[:, :n_max]
    col = torch.arange(n_max, device=table.device)
    pad = col[None, :] >= n[:, None]  # past the request's blocks: ignored
    drop = table == null_block
    drop |= pad
    keep_count = n_max - drop.sum(dim=1)
    # Every null entry drops a full block, except a null partial last block.
    last = table.gather(1, (n - 1).clamp_(min=0)[:, None])[:, 0]
    short = (last == null_block) & (n > 0)
    dropped = (n - keep_count) * block_size - short * (n * block_size - seq)
    # Kept entry -> its compacted column; everything else -> a scratch column at the end.
    dest = (~drop).cumsum(dim=1).sub_(1).masked_fill_(drop, n_max)
    staged = torch.full((r, n_max + 1), null_block, dtype=table.dtype, device=table.device)
    staged.scatter_(1, dest, table)
    out_tables[:, :n_max].copy_(staged[:, :n_max])
    out_seq_lens.copy_(seq - dropped)
