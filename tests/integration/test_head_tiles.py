"""Head-paged tiles on the CUDA backends' KV cache layouts
(integration/worker/head_tiles.py), checked on CPU.

- :class:`TileSpace` over per-layer views made by vLLM 0.32's own
  ``create_kv_cache_views``, in every ``KVCacheLayout``: the H-before-N layouts give each
  (layer, block, KV head) one tile id whose key and value views read exactly what the
  stock backends' split (``kv_cache.transpose(1, 2).split(D, -1)``) reads; the NHD
  layouts are refused with the setting to change.
- After events and moves, each unit's tile table reads exactly its kept tokens.
- vLLM's own Triton unified-attention kernel (the TRITON_ATTN backend's), interpreted on
  CPU in a child process as ``test_triton_unified_attention.py`` runs it, with
  ``num_kv_heads = 1`` over the units' tile tables == exact attention over each unit's
  kept tokens: several layers in one buffer, tables borrowing tiles across layers, a
  decode request and a prefill chunk (2D kernel), and decode units alone (3D kernel).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from nexus_vllm.integration.worker.head_tiles import TileSpace, kv_layout_name, unit_batch
from tests.integration.conftest import HAS_VLLM
from tests.integration.head_paged_case import build_case, vllm_layer_caches
from tests.integration.test_triton_unified_attention import _run_kernel

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

TILED = ["LBHNC", "BLHNC", "BHLNC", "LHBNC"]  # H before N: one tile per head-block
INTERLEAVED = ["LBNHC", "BLNHC"]  # NHD: a block's heads interleave per token
CUDA = ["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"]


def _read(space: TileSpace, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[len(tiles), bs, D]`` through the backend's kernel views."""
    key, value = space.key_value()
    if space.backend in ("FLASH_ATTN", "TRITON_ATTN"):
        return key[tiles, :, 0], value[tiles, :, 0]
    return key[tiles, 0], value[tiles, 0]


@pytest.mark.parametrize("backend", CUDA)
@pytest.mark.parametrize("layout", TILED)
def test_tile_views_read_what_the_backends_read(layout: str, backend: str) -> None:
    """Every (layer, block, KV head, token) through the tile id and the backend's
    one-head view == the same through vLLM's layer view and the stock split."""
    layers, blocks, hkv, d, bs = 3, 5, 2, 8, 4
    caches = vllm_layer_caches(layout, layers, blocks, hkv, d, bs, torch.float32, fill=0.0)
    flat = torch.empty(0).set_(caches[0].untyped_storage())
    flat.copy_(torch.arange(flat.numel(), dtype=torch.float32))  # every element distinct
    space = TileSpace.from_layers(caches, backend)
    assert space.tiles.shape == (layers * blocks * hkv, 1, bs, 2 * d)
    key, value = space.key_value()
    assert key.stride()[-1] == value.stride()[-1] == 1
    assert value.storage_offset() - key.storage_offset() == d  # K | V in one row
    seen = set()
    for layer, cache in enumerate(caches):
        k_stock, v_stock = cache.transpose(1, 2).split(d, dim=-1)  # [B, N, H, D]
        for b in range(blocks):
            for h in range(hkv):
                local = torch.tensor([b * layers * hkv + layer * hkv + h])
                tile = space.global_tiles(local, torch.arange(blocks))
                seen.add(int(tile))
                k, v = _read(space, tile)
                assert torch.equal(k[0], k_stock[b, :, h]), (layer, b, h)
                assert torch.equal(v[0], v_stock[b, :, h]), (layer, b, h)
    assert len(seen) == layers * blocks * hkv  # one id per head-block, all distinct


@pytest.mark.parametrize("backend", [*CUDA, "CPU_ATTN"])
@pytest.mark.parametrize("layout", INTERLEAVED)
def test_nhd_layouts_are_refused_with_the_setting(layout: str, backend: str) -> None:
    caches = vllm_layer_caches(layout, 2, 4, 2, 8, 4, torch.float32)
    assert kv_layout_name(caches).startswith(layout)
    with pytest.raises(ValueError, match=f"{layout}.*VLLM_KV_CACHE_LAYOUT=HND"):
        TileSpace.from_layers(caches, backend)
    # One KV head: nothing interleaves, every layout is addressable.
    TileSpace.from_layers(vllm_layer_caches(layout, 2, 4, 1, 8, 4, torch.float32), backend)


def test_unknown_backend_and_cpu_offsets_are_refused() -> None:
    caches = vllm_layer_caches("LBHNC", 2, 4, 2, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="FLEX_ATTENTION"):
        TileSpace.from_layers(caches, "FLEX_ATTENTION")
    space = TileSpace.from_layers(caches)  # CPU_ATTN by default
    assert space.token_offsets() is None
    assert TileSpace.from_layers(caches, "TRITON_ATTN").token_offsets() is not None


@pytest.mark.parametrize("layout", TILED)
def test_unit_tables_read_their_kept_tokens(layout: str) -> None:
    """After the events' token and tile moves (row layout, no probe), each unit's table
    reads its kept keys and values in attention order; some tables borrow tiles of
    other layers' slots."""
    case = build_case(layout, "TRITON_ATTN", seed=1)
    assert case.borrowed() > 0
    bs = case.space.block_size
    for layer, batch in enumerate(case.batches):
        for r in range(len(case.requests)):
            for h in range(case.hkv):
                row = r * case.hkv + h
                n = int(batch.seq_lens[row])
                k, v = _read(case.space, batch.block_table[row, : -(-n // bs)].long())
                want_k, want_v = case.kept(r, layer, h)
                assert torch.equal(k.reshape(-1, k.shape[-1])[:n], want_k), (layer, r, h)
                assert torch.equal(v.reshape(-1, v.shape[-1])[:n], want_v), (layer, r, h)


def test_unit_batch_orders_rows_by_request_then_head() -> None:
    qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
    tables = torch.arange(2 * 3 * 2).view(2, 3, 2)
    lengths = torch.tensor([[5, 6, 7], [8, 9, 10]])
    batch = unit_batch(qsl, tables, lengths)
    assert batch.query_start_loc.tolist() == [0, 1, 2, 3, 6, 9, 12]
    assert batch.seq_lens.tolist() == [5, 6, 7, 8, 9, 10]
    assert batch.block_table.dtype == torch.int32 and batch.block_table.shape == (6, 2)
    assert (batch.max_query_len, batch.max_seq_len) == (3, 10)
    # query [T=4, Hq=3 x G=2, D=1]: value = token * 10 + KV head.
    query = (torch.arange(4).view(4, 1, 1) * 10 + torch.arange(3).view(1, 3, 1)) \
        .repeat_interleave(2, dim=1).float()
    grouped = batch.gather(query, 3)
    assert grouped[:, 0, 0].tolist() == [0, 1, 2, 10, 20, 30, 11, 21, 31, 12, 22, 32]
    out = torch.empty_like(query)
    batch.scatter(grouped, out)
    assert torch.equal(out, query)


# -- vLLM's Triton unified attention (interpreted) on head-paged tiles --------------------
# The tiles are a layer cache with one KV head: the block-path test's child process runs
# them through the TRITON_ATTN backend's own split unchanged.


@pytest.mark.slow  # one child process that imports vllm (~5 s) and interprets 4 launches
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed")
def test_triton_unified_attention_on_head_paged_tiles(tmp_path: Path) -> None:
    # float32: the interpreter's bf16/fp16 dot products are not faithful.
    case = build_case("LBHNC", "TRITON_ATTN", layers=3, seed=1)
    assert case.borrowed() > 0
    launches = []  # (layer, request rows, use_3d)
    for layer in range(len(case.layers)):
        launches.append((layer, None, False))  # decode + prefill chunk: the 2D kernel
    launches.append((2, [0], True))  # decode units alone, split softmax: the 3D kernel
    cases = []
    for layer, rows, use_3d in launches:
        c = case.kernel_inputs(layer, rows)
        c.update(kv=case.space.tiles, use_3d=use_3d, seq_threshold_3D=128, segments=16)
        cases.append(c)
    results = _run_kernel(cases, tmp_path)
    for (layer, rows, use_3d), c, res in zip(launches, cases, results):
        assert res["ran_3d"] == use_3d, (layer, use_3d)
        got = case.token_outputs(res["out"].double(), c["order"])
        # float32 kernel vs float64 reference on O(1) outputs (as the block-path test:
        # ~3e-7 measured there); a wrong tile moves outputs by ~1e-1.
        torch.testing.assert_close(got, case.reference(layer, rows), atol=1e-5, rtol=1e-5,
                                   msg=lambda m, la=layer, d=use_3d: f"layer {la} 3d={d}: {m}")
