"""Head-paged attention with vLLM's compiled GPU kernels (phase 1 of
``scripts/device_check.sh``): the CPU test ``tests/integration/test_head_tiles.py`` runs
the same case with the Triton kernel interpreted.

Three layers of one buffer in an H-before-N layout (``create_kv_cache_views``), tokens
written by vLLM's CUDA ``reshape_and_cache_flash`` through the stock split, eviction
events and their moves (``TileSpace.apply``, row layout), then each layer's (request, KV
head) units over their tile tables with ``num_kv_heads = 1``: vLLM's Triton unified
attention (2D: a decode request and a prefill chunk; 3D: decode units alone) and, where
vLLM's FlashAttention is built, ``flash_attn_varlen_func``, against attention over each
unit's kept tokens (float64 reference; bound: twice the same math's error in the cache
dtype).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from tests.gpu.conftest import HAS_CUDA, HAS_VLLM

if TYPE_CHECKING:
    from tests.integration.head_paged_case import HeadPagedCase

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (HAS_CUDA and HAS_VLLM), reason="needs CUDA and vllm")]

LAYOUTS = ["LBHNC", "BLHNC"]
DTYPES = [torch.bfloat16, torch.float16]
# Each new (dtype, block size) compiles the kernel again (2D and 3D): a few, not all.
CONFIGS = [("LBHNC", 16, torch.bfloat16), ("LBHNC", 32, torch.bfloat16),
           ("BLHNC", 16, torch.bfloat16), ("LBHNC", 16, torch.float16)]
# (layer, request rows or None for all, use_3d)
LAUNCHES = [(0, None, False), (1, None, False), (2, None, False), (2, [0], True)]
FLOOR = 1e-3  # outputs are O(1); a wrong tile moves them by ~1e-1


def _vllm_writer(keys: torch.Tensor, values: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slots: torch.Tensor) -> None:
    from vllm import _custom_ops as ops

    one = torch.ones((), device=keys.device)
    ops.reshape_and_cache_flash(keys, values, key_cache, value_cache, slots, "auto", one, one)


def _case(layout: str, backend: str, block_size: int, dtype: torch.dtype) -> HeadPagedCase:
    from tests.integration.head_paged_case import build_case

    case = build_case(layout, backend, layers=3, bs=block_size, dtype=dtype, device="cuda",
                      writer=_vllm_writer, seed=0)  # seed 0 borrows at both block sizes
    assert case.borrowed() > 0
    return case


def _check(case: HeadPagedCase, layer: int, rows: list[int] | None, got: torch.Tensor,
           dtype: torch.dtype) -> None:
    want = case.reference(layer, rows)
    low = case.reference(layer, rows, dtype=dtype)
    bound = 2 * float((low - want).abs().max()) + FLOOR
    err = float((got.double().cpu() - want).abs().max())
    assert err <= bound, f"layer {layer} rows {rows}: error {err:.3e} > bound {bound:.3e}"


@pytest.mark.parametrize("layout,block_size,dtype", CONFIGS)
def test_triton_unified_attention_on_head_paged_tiles(layout: str, block_size: int,
                                                      dtype: torch.dtype) -> None:
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    case = _case(layout, "TRITON_ATTN", block_size, dtype)
    key_cache, value_cache = case.space.key_value()  # [n_tiles, bs, 1, D]
    for layer, rows, use_3d in LAUNCHES:
        c = case.kernel_inputs(layer, rows)
        q = c["query"]
        out = torch.full_like(q, float("nan"))
        segm = {}
        if use_3d:
            n, h, s = 128, q.shape[1], 16
            segm = dict(
                seq_threshold_3D=n, num_par_softmax_segments=s,
                softmax_segm_output=torch.full((n, h, s, 1 << (q.shape[2] - 1).bit_length()),
                                               float("nan"), device="cuda"),
                softmax_segm_max=torch.full((n, h, s), float("nan"), device="cuda"),
                softmax_segm_expsum=torch.full((n, h, s), float("nan"), device="cuda"))
        unified_attention(
            q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=c["query_start_loc"],
            max_seqlen_q=c["max_query_len"], seqused_k=c["seq_lens"],
            max_seqlen_k=c["max_seq_len"], softmax_scale=c["scale"], causal=True,
            window_size=(-1, -1), block_table=c["block_table"], softcap=0.0,
            q_descale=None, k_descale=None, v_descale=None, **segm)
        torch.cuda.synchronize()
        if use_3d:  # the intended kernel path ran
            assert not torch.isnan(segm["softmax_segm_max"]).all()
        _check(case, layer, rows, case.token_outputs(out, c["order"]), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flash_attn_on_head_paged_tiles(layout: str, dtype: torch.dtype) -> None:
    """vLLM's FlashAttention (the FLASH_ATTN backend's ``flash_attn_varlen_func``) on the
    same one-head tile views, when this vLLM build has it."""
    from vllm.v1.attention.backends import fa_utils

    bs, d = 16, 64  # build_case's head size
    fa_version = fa_utils.get_flash_attn_version(head_size=d, kv_cache_block_size=bs)
    if fa_version is None or not fa_utils.is_flash_attn_varlen_func_available():
        pytest.skip("vLLM's FlashAttention is not available here")

    case = _case(layout, "FLASH_ATTN", bs, dtype)
    key_cache, value_cache = case.space.key_value()
    for layer, rows, _ in LAUNCHES[:3]:
        c = case.kernel_inputs(layer, rows)
        q = c["query"]
        out = torch.full_like(q, float("nan"))
        fa_utils.flash_attn_varlen_func(
            q=q, k=key_cache, v=value_cache, max_seqlen_q=c["max_query_len"],
            cu_seqlens_q=c["query_start_loc"], max_seqlen_k=c["max_seq_len"],
            seqused_k=c["seq_lens"], softmax_scale=c["scale"], causal=True,
            block_table=c["block_table"], out=out, fa_version=fa_version)
        torch.cuda.synchronize()
        _check(case, layer, rows, case.token_outputs(out, c["order"]), dtype)
