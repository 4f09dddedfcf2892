"""Triton kernels (``@triton.jit`` only). Checks and public launchers: ``_scoring_ops.py`` and
``_compaction_ops.py`` (exported by ``ops.py``); launches: ``_launch.py``; tiling:
``_tuning.py``; the torch fallback: ``_reference.py``.

This module imports ``triton`` unconditionally and is only imported lazily (by
``_interpreter.kernel_module``) once a Triton launch is requested. ``triton.jit`` decides at
decoration time whether a kernel is compiled or interpreted (``TRITON_INTERPRET=1``), so
this module is reloaded when that mode changes.

Block scoring is split in three launches so that the key cache is read exactly once:

1. ``_block_mass_partial_kernel`` -- grid ``(R, Hkv * head_tiles, splits)``. A program loads
   the queries of ``G_TILE`` query heads that share one KV head, for all ``W`` window rows
   (``BLOCK_M = G_TILE * W_P`` rows, so each key block is read once for all of them), then
   walks its range of key blocks in *chunks* of ``CHUNK`` blocks in a single pass, ``TILE``
   tokens (``BPT`` blocks, each token's physical block looked up) per ``tl.dot``: an online
   max per row, and a register tile ``[BLOCK_M, CHUNK_TILES, BPT]`` of per-block exp-sums
   that is rescaled whenever the max grows. At the end of a chunk it stores the tile
   (``partial[r, h, i, j]``, relative to the chunk's max) and the chunk's ``(max, sum)``.
2. ``_block_mass_factor_kernel`` -- grid ``(R, Hq)``. Combines the chunk statistics into the
   row's global log-normaliser and overwrites each chunk's max with the log2 factor that
   turns its partial sums into probabilities.
3. ``_block_mass_combine_kernel`` -- grid ``(R, cdiv(max_blocks, BLOCK_N))``. Sums the
   rescaled partials over query heads (deterministic order, no atomics), divides by ``Hq``
   and stores (or adds into) ``out[r, i, j]``; with ``HEAD_MAX`` it takes their maximum
   instead and stores it (or the maximum with ``out``): ``attention_reduce="max"``.

Compaction is one launch, ``_compact_block_tables_kernel`` -- grid ``(R,)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Finite "minus infinity" for running maxima: keeps exp2(m_old - m_new) at 1, not NaN,
# while a row has seen only masked logits.
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _live_seq_len(seq_ptr, r, MAX_BLOCKS, BS: tl.constexpr):
    # Request r's token count as int32, clamped to its block table: the three scoring
    # kernels must agree on it, and none reads past the table whatever seq_lens says.
    return tl.minimum(tl.load(seq_ptr + r).to(tl.int32), MAX_BLOCKS * BS)


@triton.jit
def _block_mass_partial_kernel(
    q_ptr,  # [R, W, Hq, D]
    k_ptr,  # key cache, strided (layout folded into strides)
    bt_ptr,  # [R, max_blocks] int32/int64
    seq_ptr,  # [R] int32/int64
    part_ptr,  # [R, Hq, W_P, max_blocks] float32 (scratch)
    m_ptr,  # [R, Hq, num_chunks, W_P] float32 (scratch): chunk max (log2 domain)
    l_ptr,  # [R, Hq, num_chunks, W_P] float32 (scratch): chunk exp-sum
    stride_qr,
    stride_qw,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_btr,
    stride_btj,
    stride_pr,
    stride_ph,
    stride_pw,
    stride_mr,
    stride_mh,
    stride_mc,
    W,
    HQ,
    GROUP,  # query heads per KV head
    HEAD_TILES,  # cdiv(GROUP, G_TILE)
    D,
    MAX_BLOCKS,
    NUM_CHUNKS,
    CHUNKS_PER_PROG,
    qk_scale,  # log2(e) / sqrt(D)
    BS: tl.constexpr,
    D_P: tl.constexpr,
    W_P: tl.constexpr,
    G_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,  # blocks per statistics chunk, CHUNK_TILES * BPT
    TILE: tl.constexpr,  # tokens per tl.dot (a multiple of BS)
    BPT: tl.constexpr,  # blocks per tile, TILE // BS
    CHUNK_TILES: tl.constexpr,  # tiles per statistics chunk
    UPCAST: tl.constexpr,  # cast operands to fp32 before tl.dot (fp32 input / interpreter)
):
    r = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    kvh = pid_h // HEAD_TILES
    g0 = (pid_h % HEAD_TILES) * G_TILE

    seq_len = _live_seq_len(seq_ptr, r, MAX_BLOCKS, BS)
    n_blocks = tl.cdiv(seq_len, BS)
    n_chunks = tl.cdiv(n_blocks, CHUNK)
    c_begin = pid_s * CHUNKS_PER_PROG
    c_end = tl.minimum(c_begin + CHUNKS_PER_PROG, n_chunks)
    if c_begin >= c_end:
        return

    rows = tl.arange(0, BLOCK_M)
    g_local = rows // W_P
    win = rows % W_P
    g_in_group = g0 + g_local
    head = kvh * GROUP + g_in_group
    row_ok = (win < W) & (g_local < G_TILE) & (g_in_group < GROUP)
    q_pos = seq_len - W + win  # live position of window row `win` (negative: padding row)

    d = tl.arange(0, D_P)
    d_ok = d < D
    q_ptrs = (
        q_ptr
        + r.to(tl.int64) * stride_qr
        + win[:, None] * stride_qw
        + head[:, None] * stride_qh
        + d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    tok = tl.arange(0, TILE)
    ct = tl.arange(0, CHUNK_TILES)
    bpt = tl.arange(0, BPT)
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    bt_row = bt_ptr + r.to(tl.int64) * stride_btr
    part_rows = (
        part_ptr + r.to(tl.int64) * stride_pr + head[:, None] * stride_ph + win[:, None] * stride_pw
    )
    m_rows = m_ptr + r.to(tl.int64) * stride_mr + head * stride_mh + win
    l_rows = l_ptr + r.to(tl.int64) * stride_mr + head * stride_mh + win

    for c in range(c_begin, c_end):
        tok_begin = c * (CHUNK_TILES * TILE)
        tok_end = tl.minimum(tok_begin + CHUNK_TILES * TILE, seq_len)
        m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
        # sums[row, t, b]: exp-sum of block b of tile t of this chunk, relative to m_i.
        sums = tl.zeros([BLOCK_M, CHUNK_TILES, BPT], tl.float32)
        for t in range(0, tl.cdiv(tok_end - tok_begin, TILE)):
            pos = tok_begin + t * TILE + tok
            live = pos < seq_len
            # A tile spans BPT blocks: look each token's physical block up (repeats hit cache).
            blk = tl.load(bt_row + (pos // BS) * stride_btj, mask=live, other=0).to(tl.int64)
            k_ptrs = (
                k_head
                + blk[None, :] * stride_kb
                + (pos % BS)[None, :] * stride_kt
                + d[:, None] * stride_kd
            )
            k = tl.load(k_ptrs, mask=d_ok[:, None] & live[None, :], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = s * qk_scale
            visible = (pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            block_sums = tl.sum(tl.reshape(p, [BLOCK_M, BPT, BS]), axis=2)
            sums = sums * alpha[:, None, None]
            sums = tl.where((ct == t)[None, :, None], block_sums[:, None, :], sums)
            m_i = m_new
        col = c * (CHUNK_TILES * BPT) + ct[None, :, None] * BPT + bpt[None, None, :]
        tl.store(
            part_rows[:, :, None] + col,
            sums,
            mask=row_ok[:, None, None] & (col < n_blocks),
        )
        tl.store(m_rows + c * stride_mc, m_i, mask=row_ok)
        tl.store(l_rows + c * stride_mc, tl.sum(tl.sum(sums, axis=2), axis=1), mask=row_ok)


@triton.jit
def _block_mass_factor_kernel(
    seq_ptr,
    m_ptr,  # in: chunk max; out: log2 factor m_c - M - log2(L)
    l_ptr,
    stride_mr,
    stride_mh,
    stride_mc,
    W,
    MAX_BLOCKS,
    BS: tl.constexpr,
    CHUNK: tl.constexpr,
    W_P: tl.constexpr,
    C_TILE: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = _live_seq_len(seq_ptr, r, MAX_BLOCKS, BS)
    n_chunks = tl.cdiv(tl.cdiv(seq_len, BS), CHUNK)
    win = tl.arange(0, W_P)
    w_ok = win < W
    cc = tl.arange(0, C_TILE)
    base = r.to(tl.int64) * stride_mr + h * stride_mh + win[None, :]

    big_m = tl.full([W_P], _NEG_BIG, tl.float32)
    big_l = tl.zeros([W_P], tl.float32)
    for c0 in range(0, n_chunks, C_TILE):
        c = c0 + cc
        ok = (c < n_chunks)[:, None] & w_ok[None, :]
        m_c = tl.load(m_ptr + base + c[:, None] * stride_mc, mask=ok, other=_NEG_BIG)
        l_c = tl.load(l_ptr + base + c[:, None] * stride_mc, mask=ok, other=0.0)
        m_new = tl.maximum(big_m, tl.max(m_c, axis=0))
        big_l = big_l * tl.exp2(big_m - m_new) + tl.sum(l_c * tl.exp2(m_c - m_new[None, :]), axis=0)
        big_m = m_new
    # Rows that see no token at all (padding rows) get factor -inf, i.e. mass 0.
    log_norm = tl.where(big_l > 0, big_m + tl.log2(tl.maximum(big_l, 1e-38)), float("inf"))
    for c0 in range(0, n_chunks, C_TILE):
        c = c0 + cc
        ok = (c < n_chunks)[:, None] & w_ok[None, :]
        ptrs = m_ptr + base + c[:, None] * stride_mc
        m_c = tl.load(ptrs, mask=ok, other=_NEG_BIG)
        tl.store(ptrs, m_c - log_norm[None, :], mask=ok)


@triton.jit
def _block_mass_combine_kernel(
    seq_ptr,
    part_ptr,
    f_ptr,  # log2 factors from _block_mass_factor_kernel
    out_ptr,  # [R, W, max_blocks] float32
    stride_pr,
    stride_ph,
    stride_pw,
    stride_mr,
    stride_mh,
    stride_mc,
    stride_or,
    stride_ow,
    stride_oj,
    W,
    HQ,
    MAX_BLOCKS,
    inv_hq,
    BS: tl.constexpr,
    CHUNK: tl.constexpr,
    W_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    HEAD_MAX: tl.constexpr,  # max over heads (and with out) instead of mean (and sum)
):
    r = tl.program_id(0)
    pid_n = tl.program_id(1)
    seq_len = _live_seq_len(seq_ptr, r, MAX_BLOCKS, BS)
    n_blocks = tl.cdiv(seq_len, BS)
    win = tl.arange(0, W_P)
    j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (win < W)[:, None] & (j < n_blocks)[None, :]
    chunk = j // CHUNK

    acc = tl.zeros([W_P, BLOCK_N], tl.float32)
    if pid_n * BLOCK_N < n_blocks:
        p_base = part_ptr + r.to(tl.int64) * stride_pr + win[:, None] * stride_pw + j[None, :]
        f_base = f_ptr + r.to(tl.int64) * stride_mr + win[:, None] + chunk[None, :] * stride_mc
        for h in range(0, HQ):
            p = tl.load(p_base + h * stride_ph, mask=live, other=0.0)
            f = tl.load(f_base + h * stride_mh, mask=live, other=float("-inf"))
            if HEAD_MAX:
                acc = tl.maximum(acc, p * tl.exp2(f))
            else:
                acc += p * tl.exp2(f)
        if not HEAD_MAX:
            acc = acc * inv_hq

    o_ptrs = (
        out_ptr + r.to(tl.int64) * stride_or + win[:, None] * stride_ow + j[None, :] * stride_oj
    )
    o_mask = (win < W)[:, None] & (j < MAX_BLOCKS)[None, :]
    if ACCUMULATE:
        if HEAD_MAX:
            acc = tl.maximum(acc, tl.load(o_ptrs, mask=o_mask, other=0.0))
        else:
            acc += tl.load(o_ptrs, mask=o_mask, other=0.0)
    tl.store(o_ptrs, acc, mask=o_mask)


@triton.jit
def _compact_block_tables_kernel(
    bt_ptr,  # [R, M] in
    seq_ptr,  # [R] in
    out_bt_ptr,  # [R, M] out
    out_seq_ptr,  # [R] out
    stride_btr,
    stride_btj,
    stride_obr,
    stride_obj,
    M,
    null_block,
    BS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    seq_len = tl.load(seq_ptr + r)
    n_blocks = tl.minimum(tl.cdiv(seq_len, BS), M)
    offs = tl.arange(0, BLOCK)
    row = bt_ptr + r.to(tl.int64) * stride_btr
    out_row = out_bt_ptr + r.to(tl.int64) * stride_obr
    kept = seq_len * 0  # same integer type as seq_len
    dropped = seq_len * 0
    for j0 in range(0, M, BLOCK):
        j = j0 + offs
        in_seq = j < n_blocks
        ids = tl.load(row + j * stride_btj, mask=in_seq, other=null_block)
        keep = in_seq & (ids != null_block)
        # A null entry drops the tokens its logical block held (a full block except,
        # possibly, the last one).
        held = tl.minimum(tl.maximum(seq_len - j * BS, 0), BS)
        dropped += tl.sum(tl.where(in_seq & (ids == null_block), held, 0), axis=0)
        dest = kept + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(out_row + dest * stride_obj, ids, mask=keep)
        kept += tl.sum(keep.to(tl.int32), axis=0)
    for j0 in range(0, M, BLOCK):
        j = j0 + offs
        pad = (j >= kept) & (j < M)
        tl.store(out_row + j * stride_obj, tl.zeros([BLOCK], tl.int32) + null_block, mask=pad)
    tl.store(out_seq_ptr + r, seq_len - dropped)
