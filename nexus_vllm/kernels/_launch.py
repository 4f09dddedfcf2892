"""Triton launch code: grids, scratch buffers and strides for the ``_triton_kernels`` launches.

Called by the typed launchers (``_scoring_ops.py``, ``_compaction_ops.py``) once arguments
are checked and the backend resolved to ``"triton"``; ``_tuning.py`` picks the tiling and
``_interpreter.py`` supplies the kernel module (compiled or interpreted) and the launch
context. Importing this module does not import triton.
"""

from __future__ import annotations

import math

import torch

from nexus_vllm.core.scoring import cdiv
from nexus_vllm.kernels._interpreter import (
    kernel_module,
    launch_context,
    triton_interpret_enabled,
)
from nexus_vllm.kernels._tuning import (
    BLOCK_N,
    CHUNK,
    compact_tile,
    factor_chunk_tile,
    num_programs_target,
    scoring_config,
)


def block_mass_triton(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_layout: str,
    accumulate: bool,
    head_max: bool = False,
) -> None:
    """Block scoring in three launches (partial, factor, combine); writes into ``out``, or
    combines with it (adds; with ``head_max`` the maximum over heads and with ``out``)."""
    seq_lens = seq_lens.contiguous()  # the kernels index it with stride 1
    r, w, hq, d = queries.shape
    max_blocks = block_tables.shape[1]
    if r == 0 or w == 0 or max_blocks == 0:
        if not accumulate:
            out.zero_()
        return
    # The kernel reads the cache as NHD: an HND cache is its transposed view (same storage).
    nhd = key_cache if kv_layout == "NHD" else key_cache.transpose(1, 2)
    _, bs, hkv, _ = nhd.shape
    s_kb, s_kt, s_kh, s_kd = nhd.stride()
    cfg = scoring_config(queries.dtype, w, hq, hkv, d, bs, interpret=triton_interpret_enabled())
    num_chunks = cdiv(max_blocks, CHUNK)
    base_programs = r * hkv * cfg.head_tiles
    splits = max(1, min(num_chunks, cdiv(num_programs_target(queries.device), base_programs)))
    chunks_per_prog = cdiv(num_chunks, splits)
    splits = cdiv(num_chunks, chunks_per_prog)

    dev = queries.device
    partial = torch.empty((r, hq, cfg.w_p, max_blocks), dtype=torch.float32, device=dev)
    m_buf = torch.empty((r, hq, num_chunks, cfg.w_p), dtype=torch.float32, device=dev)
    l_buf = torch.empty_like(m_buf)
    with launch_context():
        k = kernel_module()
        k._block_mass_partial_kernel[(r, hkv * cfg.head_tiles, splits)](
            queries, key_cache, block_tables, seq_lens, partial, m_buf, l_buf,
            *queries.stride(),
            s_kb, s_kt, s_kh, s_kd,
            *block_tables.stride(),
            partial.stride(0), partial.stride(1), partial.stride(2),
            m_buf.stride(0), m_buf.stride(1), m_buf.stride(2),
            w, hq, hq // hkv, cfg.head_tiles, d, max_blocks, num_chunks, chunks_per_prog,
            math.log2(math.e) / math.sqrt(d),
            **cfg.partial_constexprs(), num_warps=cfg.num_warps,
        )  # fmt: skip
        k._block_mass_factor_kernel[(r, hq)](
            seq_lens, m_buf, l_buf,
            m_buf.stride(0), m_buf.stride(1), m_buf.stride(2),
            w, max_blocks,
            BS=bs, CHUNK=CHUNK, W_P=cfg.w_p, C_TILE=factor_chunk_tile(cfg.w_p),
        )  # fmt: skip
        k._block_mass_combine_kernel[(r, cdiv(max_blocks, BLOCK_N))](
            seq_lens, partial, m_buf, out,
            partial.stride(0), partial.stride(1), partial.stride(2),
            m_buf.stride(0), m_buf.stride(1), m_buf.stride(2),
            *out.stride(),
            w, hq, max_blocks, 1.0 / hq,
            BS=bs, CHUNK=CHUNK, W_P=cfg.w_p, BLOCK_N=BLOCK_N, ACCUMULATE=accumulate,
            HEAD_MAX=head_max,
        )  # fmt: skip


def compact_triton(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    null_block: int,
    out_tables: torch.Tensor,
    out_seq_lens: torch.Tensor,
) -> None:
    """Block-table compaction in one launch (grid ``(R,)``) into the output buffers."""
    r, max_blocks = block_tables.shape
    if r == 0:
        return
    seq_lens = seq_lens.contiguous()  # the kernel indexes both with stride 1
    seq_out = out_seq_lens if out_seq_lens.is_contiguous() else torch.empty_like(seq_lens)
    with launch_context():
        kernel_module()._compact_block_tables_kernel[(r,)](
            block_tables, seq_lens, out_tables, seq_out,
            *block_tables.stride(), *out_tables.stride(),
            max_blocks, null_block,
            BS=block_size, BLOCK=compact_tile(max_blocks),
        )  # fmt: skip
    if seq_out is not out_seq_lens:
        out_seq_lens.copy_(seq_out)
