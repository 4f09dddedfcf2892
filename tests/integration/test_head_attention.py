"""Head-paged attention on vLLM's CPU cache (integration/worker/head_attention.py): the
stock kernel over each (request, layer, KV head)'s own tiles, after the moves of
core/head_pages.py, against dense attention over exactly the tokens each unit kept."""

from __future__ import annotations

import math

import pytest
import torch

from nexus_vllm.core.head_pages import HeadPages
from nexus_vllm.integration.worker.head_attention import (
    TileSpace,
    cpu_token_offsets,
    head_paged_attention,
)
from tests.core.test_head_pages import _random_keep

pytest.importorskip("vllm")

# (layers, KV heads, query heads per KV head, head size, block size)
SHAPES = [(2, 2, 3, 64, 32), (3, 1, 2, 64, 32)]
DTYPES = [torch.float32, torch.bfloat16]
SEEDS = [0, 1]
NUM_BLOCKS = 24
# Prompt steps per request (an event after each), then the tokens of the checked step
# (a decode token for request 0, a prefill chunk for request 1).
STEPS = [(70, 45, 50), (40, 90)]
QUERY_TOKENS = [1, 7]


def _isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size)


class VllmCpuCache:
    """Layer views of one buffer, as vLLM 0.32's allocate_kv_cache makes them (LBHNC)."""

    def __init__(self, layers: int, hkv: int, d: int, bs: int, dtype: torch.dtype, isa: str):
        tile = bs * 2 * d
        self.raw = torch.zeros(layers * NUM_BLOCKS * hkv * tile, dtype=dtype)
        self.layers = [self.raw.as_strided((NUM_BLOCKS, hkv, bs, 2 * d),
                                           (hkv * tile, tile, 2 * d, 1),
                                           layer * NUM_BLOCKS * hkv * tile)
                       for layer in range(layers)]
        self.bs, self.isa = bs, isa

    def write(self, keys: torch.Tensor, values: torch.Tensor, block_ids: torch.Tensor,
              start: int, end: int) -> None:
        """Tokens ``[start, end)`` of ``keys``/``values`` ``[L, N, Hkv, D]`` at their
        logical slots, with vLLM's writer (what the stock attention layer does)."""
        from nexus_vllm.integration.compat.vllm_compat import cpu_cache_writer

        writer = cpu_cache_writer()
        pos = torch.arange(start, end)
        slots = block_ids[pos // self.bs].long() * self.bs + pos % self.bs
        for layer, cache in enumerate(self.layers):
            nb, hkv, bs, two_d = cache.shape
            kc, vc = cache.view(nb, hkv, 2 * bs, two_d // 2).chunk(2, dim=2)
            writer(keys[layer, start:end].contiguous(), values[layer, start:end].contiguous(),
                   kc, vc, slots, self.isa, 1.0, 1.0, "auto")


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` rows; q ``[n, G, D]``, k/v ``[S, D]``."""
    n, s = q.shape[0], keys.shape[0]
    logits = torch.einsum("ngd,sd->ngs", q, keys) * scale
    allowed = torch.arange(s).view(1, s) <= (torch.arange(n) + s - n).view(n, 1)
    logits = logits.masked_fill(~allowed.view(n, 1, s), float("-inf"))
    return torch.einsum("ngs,sd->ngd", logits.softmax(-1), values)


@pytest.mark.parametrize("layers,hkv,group,d,bs", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_head_paged_attention_matches_dense_over_kept_tokens(
        layers: int, hkv: int, group: int, d: int, bs: int, dtype: torch.dtype,
        seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    isa = _isa(dtype, bs, d)
    cache = VllmCpuCache(layers, hkv, d, bs, dtype, isa)
    space = TileSpace.from_layers(cache.layers)
    offsets = cpu_token_offsets(isa, d, bs, dtype)
    units = layers * hkv
    order = torch.randperm(NUM_BLOCKS, generator=gen)
    requests = []
    for r, steps in enumerate(STEPS):
        total = sum(steps) + QUERY_TOKENS[r]
        n_blocks = -(-total // bs)
        block_ids = order[:n_blocks]
        order = order[n_blocks:]
        keys = torch.randn(layers, total, hkv, d, generator=gen).to(dtype)
        values = torch.randn(layers, total, hkv, d, generator=gen).to(dtype)
        pages, seen = HeadPages.fresh(units, bs), 0
        for step in steps:
            cache.write(keys, values, block_ids, seen, seen + step)
            seen += step
            pages, event = pages.plan_event(_random_keep(pages, seen, gen), seen)
            space.apply(event, block_ids, offsets)
        cache.write(keys, values, block_ids, seen, total)
        requests.append((block_ids, keys, values, pages, total))

    query_start_loc = torch.tensor([0, *torch.tensor(QUERY_TOKENS).cumsum(0).tolist()],
                                   dtype=torch.int32)
    query = torch.randn(int(query_start_loc[-1]), hkv * group, d, generator=gen).to(dtype)
    scale = 1 / math.sqrt(d)
    for layer in range(layers):
        tables, lengths = [], []
        for block_ids, _, _, pages, total in requests:
            local, length = pages.tables(total)
            rows = local[layer * hkv:(layer + 1) * hkv]
            tables.append(space.global_tiles(rows, block_ids))
            lengths.append(length[layer * hkv:(layer + 1) * hkv])
        width = max(t.shape[1] for t in tables)
        table = torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[1]))
                             for t in tables])
        out = torch.empty_like(query)
        head_paged_attention(query, out, space, query_start_loc, table, torch.stack(lengths),
                             scale=scale, isa=isa)
        for r, (_, keys, values, pages, total) in enumerate(requests):
            rows = slice(int(query_start_loc[r]), int(query_start_loc[r + 1]))
            edge = pages.tail_block * bs
            for h in range(hkv):
                u = layer * hkv + h
                pos = torch.cat([pages.unit_positions[u], torch.arange(edge, total)])
                q = query[rows, h * group:(h + 1) * group].float()
                want = _reference(q, keys[layer, pos, h].float(), values[layer, pos, h].float(),
                                  scale)
                low = _reference(q.to(dtype), keys[layer, pos, h], values[layer, pos, h],
                                 scale).float()
                got = out[rows, h * group:(h + 1) * group].float()
                # The kernel's error at most twice the same math's in the cache dtype.
                tol = 2 * float((low - want).abs().max()) + 1e-5
                assert float((got - want).abs().max()) <= tol, (r, layer, h)


def test_token_offsets_are_a_permutation_of_the_tile() -> None:
    isa = _isa(torch.bfloat16, 32, 64)
    offsets = cpu_token_offsets(isa, 64, 32, torch.bfloat16)
    assert offsets.shape == (32, 128)
    assert torch.equal(offsets.view(-1).sort().values, torch.arange(32 * 128))


def test_layers_in_separate_buffers_are_refused() -> None:
    caches = [torch.zeros(4, 2, 32, 128), torch.zeros(4, 2, 32, 128)]
    with pytest.raises(ValueError, match="one buffer"):
        TileSpace.from_layers(caches)
    strided = torch.zeros(4, 32, 2, 128).transpose(1, 2)  # heads not contiguous tiles
    with pytest.raises(ValueError, match="contiguous tile"):
        TileSpace.from_layers([strided])
