"""Torch paths of the kernels: the reference, and what runs without Triton.

``block_attention_mass_paged_torch`` is ``nexus_vllm.core.block_attention_mass_paged`` per
request (the definition the kernels are tested against); ``block_attention_mass_paged_batched``
is the same math vectorised over requests (the vLLM plugin's CPU scorer);
``compact_block_tables_torch`` is the compaction in a handful of tensor ops. Arguments are
checked by the public launchers in ``ops.py``; here only values are (``seq_lens``).
Pure torch: no triton import.
"""

from __future__ import annotations

import math

import torch

from nexus_vllm.core.scoring import block_attention_mass_paged as _core_mass_paged
from nexus_vllm.core.scoring import num_blocks_for


def block_size_of(key_cache: torch.Tensor, kv_layout: str) -> int:
    """Tokens per block of a ``"NHD"`` or ``"HND"`` key cache."""
    return int(key_cache.shape[1] if kv_layout == "NHD" else key_cache.shape[2])


def block_attention_mass_paged_torch(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_layout: str = "NHD",
) -> torch.Tensor:
    """Torch fallback: ``core.block_attention_mass_paged`` per request, added into ``out``.

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
            queries[r, w - w_live :], key_cache, block_tables[r], seq_len, kv_layout=kv_layout
        )
        out[r, w - w_live :, :n] += mass
    return out


# Scratch budget of the batched path (float32 logits per chunk of requests): bounds its
# memory whatever the batch. 2 MiB chunks measured faster on CPU than 64 MiB ones
# (benchmarks/kernels/cpu_scoring.py): the softmax stays in cache.
_BATCHED_LOGITS = 1 << 19


# Additive mask value: finite, so a fully masked row gives a (discarded) uniform row
# instead of NaN.
_MASKED = -1.0e30


def block_attention_mass_paged_batched(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_layout: str = "NHD",
) -> torch.Tensor:
    """The torch path vectorised over requests: added into ``out`` like the others.

    All requests' keys are gathered through their (whole) block-table rows at once, and
    one masked softmax per chunk of requests replaces the per-request loop; keys past a
    request's length are masked, so garbage entries past its blocks never count. Reads no
    value back to the host.
    """
    r, w, hq, d = queries.shape
    m = block_tables.shape[1]
    if r == 0 or w == 0 or m == 0:
        return out
    nb = key_cache.shape[0]
    if kv_layout == "NHD":
        bs, hkv = key_cache.shape[1], key_cache.shape[2]
    else:
        hkv, bs = key_cache.shape[1], key_cache.shape[2]
    g, t = hq // hkv, m * bs
    scale = 1.0 / math.sqrt(d)
    key_pos = torch.arange(t, device=queries.device)
    step = max(1, _BATCHED_LOGITS // max(1, hq * w * t))
    for lo in range(0, r, step):
        hi = min(r, lo + step)
        ids = block_tables[lo:hi].long().clamp(0, nb - 1).reshape(-1)
        blocks = key_cache.index_select(0, ids).float()
        if kv_layout == "NHD":  # [n, bs, Hkv, D] -> [R, Hkv, M * bs, D]
            keys = blocks.view(hi - lo, m, bs, hkv, d).permute(0, 3, 1, 2, 4)
        else:  # [n, Hkv, bs, D]
            keys = blocks.view(hi - lo, m, hkv, bs, d).permute(0, 2, 1, 3, 4)
        keys = keys.reshape(hi - lo, hkv, t, d)
        # Query heads grouped by KV head: [R * Hkv, G * W, D], rows g-major.
        q = queries[lo:hi].float().view(hi - lo, w, hkv, g, d).permute(0, 2, 3, 1, 4)
        pos = seq_lens[lo:hi].long()[:, None] - w + torch.arange(w, device=queries.device)
        # Additive mask (future or absent keys), fused into the matmul by baddbmm; a
        # finite floor keeps rows at negative positions NaN-free (they are zeroed below).
        bias = torch.zeros(hi - lo, w, t, device=queries.device)
        bias.masked_fill_(key_pos[None, None, :] > pos[:, :, None], _MASKED)
        bias = bias[:, None, None].expand(hi - lo, hkv, g, w, t).reshape(-1, g * w, t)
        logits = torch.baddbmm(bias, q.reshape(-1, g * w, d), keys.reshape(-1, t, d)
                               .transpose(-1, -2), alpha=scale)
        probs = torch.softmax(logits, dim=-1).view(hi - lo, hkv * g, w, m, bs)
        mass = probs.sum(dim=-1).mean(dim=1) * (pos >= 0)[:, :, None]
        out[lo:hi] += mass
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
