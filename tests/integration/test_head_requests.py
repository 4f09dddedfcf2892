"""The worker's head-paged requests (integration/worker/head_requests.py): events decided
from per-head scores, made in vLLM's CPU cache, blocks given back and reused by others,
and the step's per-layer tables read by vLLM's stock kernel == dense attention over what
each head kept."""

from __future__ import annotations

import math

import pytest
import torch

from nexus_vllm.integration.worker.head_attention import (
    TileSpace,
    cpu_token_offsets,
    head_paged_attention,
)
from nexus_vllm.integration.worker.head_requests import HeadEventRequest, HeadRequests
from tests.integration.test_head_attention import NUM_BLOCKS, VllmCpuCache, _isa, _reference

pytest.importorskip("vllm")

LAYERS, HKV, GROUP, D, BS = 2, 2, 2, 64, 32
BUDGET_BLOCKS = 4
# Per request: prompt chunks (an event after each), then the checked step's tokens.
CHUNKS = {"a": [100, 60, 70], "b": [50, 120]}
QUERY = {"a": 1, "b": 9}


def _blocks_of(requests: HeadRequests, req_id: str, seen: int) -> set[int]:
    req = requests.requests[req_id]
    return {int(req.block_ids[i]) for i in req.pages.blocks_held(seen)}


@pytest.mark.parametrize("seed", [0, 1])
def test_events_free_blocks_that_others_may_overwrite(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32
    isa = _isa(dtype, BS, D)
    cache = VllmCpuCache(LAYERS, HKV, D, BS, dtype, isa)
    space = TileSpace.from_layers(cache.layers)
    requests = HeadRequests(space, cpu_token_offsets(isa, D, BS, dtype))
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    state: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
    step, freed_total = 0, 0
    for req_id, chunks in CHUNKS.items():
        total = sum(chunks) + QUERY[req_id]
        keys = torch.randn(LAYERS, total, HKV, D, generator=gen)
        values = torch.randn(LAYERS, total, HKV, D, generator=gen)
        requests.add(req_id)
        seen = 0
        for chunk in chunks:
            # vLLM appends blocks for the chunk; freed ones went back to the pool.
            block_ids = requests.requests[req_id].block_ids.tolist()
            while len(block_ids) * BS < seen + chunk:
                block_ids.append(free.pop(0))
            requests.set_blocks(req_id, torch.tensor(block_ids))
            cache.write(keys, values, requests.requests[req_id].block_ids, seen, seen + chunk)
            requests.record_scores(req_id, torch.arange(seen, seen + chunk),
                                   torch.rand(LAYERS * HKV, chunk, generator=gen))
            seen += chunk
            step += 1
            ask = HeadEventRequest(step_id=step, seen=seen, budget_blocks=BUDGET_BLOCKS)
            freed = requests.evict(req_id, ask)
            assert len(_blocks_of(requests, req_id, seen)) <= BUDGET_BLOCKS
            # A plan sent again: the same answer, nothing moved.
            before = cache.raw.clone()
            assert torch.equal(requests.evict(req_id, ask), freed)
            assert torch.allclose(cache.raw, before, rtol=0, atol=0, equal_nan=True)
            # The freed blocks go back to the pool and another request writes them.
            physical = requests.requests[req_id].block_ids[freed].tolist()
            for layer_cache in cache.layers:
                layer_cache[physical] = float("nan")
            free.extend(physical)
            freed_total += len(physical)
        requests.acknowledged(step)
        assert not requests.requests[req_id].events
        block_ids = requests.requests[req_id].block_ids.tolist()
        while len(block_ids) * BS < total:
            block_ids.append(free.pop(0))
        requests.set_blocks(req_id, torch.tensor(block_ids))
        cache.write(keys, values, requests.requests[req_id].block_ids, seen, total)
        state[req_id] = (keys, values, total)

    assert freed_total >= 4  # the events gave blocks back, and they were overwritten
    ids = list(CHUNKS)
    starts = torch.tensor([0, *torch.tensor([QUERY[i] for i in ids]).cumsum(0).tolist()],
                          dtype=torch.int32)
    query = torch.randn(int(starts[-1]), HKV * GROUP, D, generator=gen)
    tables, lengths = requests.layer_tables(ids, [state[i][2] for i in ids])
    scale = 1 / math.sqrt(D)
    for layer in range(LAYERS):
        out = torch.empty_like(query)
        head_paged_attention(query, out, space, starts, tables[layer], lengths[layer],
                             scale=scale, isa=isa)
        assert not bool(out.isnan().any())  # no freed (overwritten) block is read
        for r, req_id in enumerate(ids):
            keys, values, total = state[req_id]
            pages = requests.requests[req_id].pages
            rows = slice(int(starts[r]), int(starts[r + 1]))
            for h in range(HKV):
                u = layer * HKV + h
                pos = torch.cat([pages.unit_positions[u],
                                 torch.arange(pages.tail_block * BS, total)])
                want = _reference(query[rows, h * GROUP:(h + 1) * GROUP],
                                  keys[layer, pos, h], values[layer, pos, h], scale)
                got = out[rows, h * GROUP:(h + 1) * GROUP]
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
