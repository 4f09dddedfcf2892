"""The scoring kernel on KV caches written by vLLM's own CUDA cache writer, through the
key view the plugin uses for the CUDA backends (both physical layouts vLLM allocates)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import HAS_CUDA, HAS_VLLM
from tests.kernels.test_block_scoring import ATOL_FLOOR, _mass_in_dtype

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (HAS_CUDA and HAS_VLLM), reason="needs CUDA and vllm")]

SEED = 5
BLOCK_SIZES = [16, 32]
LAYOUTS = ["NHD", "HND"]  # physical order of [blocks, tokens|heads, heads|tokens, 2 * D]
DTYPES = [torch.bfloat16, torch.float16]
HQ, HKV, D, W = 8, 2, 128, 16


def _cache(num_blocks: int, bs: int, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """A logical ``[num_blocks, Hkv, bs, 2 * D]`` cache with vLLM's physical strides."""
    if layout == "NHD":
        phys = torch.zeros(num_blocks, bs, HKV, 2 * D, dtype=dtype, device="cuda")
        return phys.permute(0, 2, 1, 3)
    return torch.zeros(num_blocks, HKV, bs, 2 * D, dtype=dtype, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_scoring_on_vllm_written_cache(block_size: int, layout: str,
                                       dtype: torch.dtype) -> None:
    from vllm import _custom_ops as ops

    from nexus_vllm.integration.worker.attention import key_view
    from nexus_vllm.kernels import block_attention_mass_paged

    torch.manual_seed(SEED)
    lens = [5 * block_size - 3, 3 * block_size, 9 * block_size + 1]
    num_blocks = 64
    kv = _cache(num_blocks, block_size, layout, dtype)
    # The way FlashAttention/Triton/FlashInfer read it: (B, H, N, 2D) -> K, V (B, N, H, D).
    k_cache, v_cache = kv.transpose(1, 2).split(D, dim=-1)
    perm = torch.randperm(num_blocks - 1)[: sum(-(-n // block_size) for n in lens)] + 1
    tables, keys, start = [], [], 0
    for n in lens:
        nb = -(-n // block_size)
        blocks = perm[start: start + nb]
        start += nb
        key = torch.randn(n, HKV, D, dtype=dtype, device="cuda")
        slots = (blocks.cuda()[torch.arange(n, device="cuda") // block_size] * block_size
                 + torch.arange(n, device="cuda") % block_size)
        one = torch.ones((), device="cuda")
        ops.reshape_and_cache_flash(key, torch.randn_like(key), k_cache, v_cache, slots, "auto",
                                    one, one)
        tables.append(blocks)
        keys.append(key)
    width = max(len(t) for t in tables)
    table = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
    for r, t in enumerate(tables):
        table[r, : len(t)] = t.to(torch.int32)
    q = torch.randn(len(lens), W, HQ, D, dtype=dtype, device="cuda")
    view = key_view("FLASH_ATTN", kv, D)
    got = block_attention_mass_paged(q, view, table, torch.tensor(lens, device="cuda"),
                                     kv_layout="HND", backend="triton")
    for r, _ in enumerate(lens):
        # Bound: 2x the error of the same math in the input dtype (vs float64).
        exact = _mass_in_dtype(q[r], keys[r], block_size, torch.float64)
        lowp = _mass_in_dtype(q[r], keys[r], block_size, dtype).double()
        n = exact.shape[1]
        err = (got[r, :, :n].double() - exact).abs().max().item()
        bound = 2.0 * (lowp - exact).abs().max().item() + ATOL_FLOOR[dtype]
        assert err <= bound, f"request {r}: kernel error {err:.3e} > bound {bound:.3e}"
