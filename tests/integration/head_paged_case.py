"""A head-paged batch on a KV cache laid out as vLLM 0.32 lays it out for the CUDA
backends (``create_kv_cache_views`` over one buffer, any ``KVCacheLayout``), shared by
the CPU tests (``test_head_tiles.py``, ``test_builder_contracts.py``) and the GPU test
(``tests/gpu/test_gpu_head_paged.py``).

Requests write tokens with the stock backends' key/value split of each layer's view, an
eviction event (``core/head_pages.py``, random kept sets) follows each prompt step and
:meth:`TileSpace.apply` makes its moves; then each layer's per-(request, KV head) tables
and lengths become one :class:`UnitBatch`. Request 0 decodes one token, request 1 runs a
prefill chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nexus_vllm.core.head_pages import HeadPages
from nexus_vllm.integration.worker.head_tiles import TileSpace, UnitBatch, unit_batch
from tests.integration.test_head_attention import _random_keep, _reference

# Prompt steps per request (an event after each), then the checked step's query tokens.
STEPS = [(40, 30, 25), (45, 38)]
QUERY_TOKENS = [1, 7]
# Writes ``keys``/``values`` ``[n, Hkv, D]`` at ``slots`` into one layer's key/value caches
# ``[B, N, Hkv, D]`` (the stock split); vLLM's ``reshape_and_cache_flash`` on a GPU.
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def index_writer(keys: torch.Tensor, values: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """What ``reshape_and_cache_flash`` does, by indexing (CPU)."""
    bs = key_cache.shape[1]
    key_cache[slots // bs, slots % bs] = keys
    value_cache[slots // bs, slots % bs] = values


def vllm_layer_caches(layout: str, layers: int, num_blocks: int, hkv: int, d: int, bs: int,
                      dtype: torch.dtype, device: str = "cpu",
                      fill: float = float("nan")) -> list[torch.Tensor]:
    """Per-layer ``[B, Hkv, N, 2D]`` views of one buffer, made by vLLM 0.32's own
    ``create_kv_cache_views`` as ``allocate_kv_cache`` makes them for ``layout``."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=bs, num_kv_heads=hkv, head_size=d, dtype=dtype)
    kv_layout = KVCacheLayout[layout]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, layers, kv_layout)
    size = layers * num_blocks * spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=[f"layer.{i}" for i in range(layers)],
                           layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    raw.view(dtype).fill_(fill)
    return create_kv_cache_views(raw, spec, num_blocks, kv_layout, tensor)


@dataclass
class Request:
    block_ids: torch.Tensor
    keys: torch.Tensor  # [L, total, Hkv, D]
    values: torch.Tensor
    pages: HeadPages
    total: int


@dataclass
class HeadPagedCase:
    """A head-paged batch: its cache, requests, queries and per-layer unit batches."""

    space: TileSpace
    layers: list[torch.Tensor]
    requests: list[Request]
    hkv: int
    group: int
    query_start_loc: torch.Tensor  # IntTensor[R + 1]
    query: torch.Tensor  # [T, Hq, D]
    local_tables: list[torch.Tensor]  # per layer: LongTensor[R, Hkv, W] local tile ids
    batches: list[UnitBatch]  # per layer

    @property
    def scale(self) -> float:
        return float(self.query.shape[-1]) ** -0.5

    def kept(self, r: int, layer: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values ``[S, D]`` unit (``r``, ``layer``, ``h``) holds, packed
        tokens first, the tail in order (its queries last)."""
        req = self.requests[r]
        bs = req.pages.block_size
        u = layer * self.hkv + h
        pos = torch.cat([req.pages.unit_positions[u],
                         torch.arange(req.pages.tail_block * bs, req.total)])
        return req.keys[layer, pos, h], req.values[layer, pos, h]

    def reference(self, layer: int, rows: list[int] | None = None,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Attention of ``layer`` over each unit's kept tokens, computed in ``dtype`` on
        CPU (float64: exact), for the requests ``rows`` (all by default): float64
        ``[their query tokens, Hq, D]``."""
        outs = []
        g = self.group
        for r in rows if rows is not None else range(len(self.requests)):
            span = slice(int(self.query_start_loc[r]), int(self.query_start_loc[r + 1]))
            out = torch.empty(span.stop - span.start, self.hkv * g, self.query.shape[-1],
                              dtype=torch.float64)
            for h in range(self.hkv):
                k, v = (x.cpu().to(dtype) for x in self.kept(r, layer, h))
                q = self.query[span, h * g:(h + 1) * g].cpu().to(dtype)
                out[:, h * g:(h + 1) * g] = _reference(q, k, v, self.scale).double()
            outs.append(out)
        return torch.cat(outs)

    def kernel_inputs(self, layer: int, rows: list[int] | None = None) -> dict[str, Any]:
        """``unified_attention``'s inputs (but the caches) for ``layer``'s units of the
        requests ``rows`` (all by default, else a sub-batch of whole requests in order),
        as the TRITON_ATTN backend would pass head-paged metadata; ``order`` maps the
        units' rows back (:meth:`token_outputs`)."""
        batch = self.batches[layer]
        qsl, query = self.query_start_loc, self.query
        if rows is not None:
            r_all = len(self.requests)
            tables = batch.block_table.view(r_all, self.hkv, -1)[rows]
            lengths = batch.seq_lens.view(r_all, self.hkv)[rows]
            spans = [torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in rows]
            query = query[torch.cat(spans).to(query.device)]
            qsl = torch.tensor([0, *torch.tensor([len(s) for s in spans]).cumsum(0).tolist()],
                               dtype=torch.int32)
            batch = unit_batch(qsl, tables, lengths)
        return {
            "query": batch.gather(query, self.hkv), "order": batch.order,
            "query_start_loc": batch.query_start_loc, "max_query_len": batch.max_query_len,
            "seq_lens": batch.seq_lens, "max_seq_len": batch.max_seq_len,
            "block_table": batch.block_table, "scale": self.scale,
            "head_size": self.query.shape[-1],
        }

    def token_outputs(self, unit_out: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """The units' outputs ``[T' x Hkv, G, D]`` (rows as :meth:`kernel_inputs` ordered
        them) as ``[T', Hq, D]``."""
        rows = unit_out.shape[0]
        out = unit_out.new_empty(rows // self.hkv, self.hkv * self.group, unit_out.shape[-1])
        out.view(rows, self.group, -1)[order.to(out.device)] = unit_out
        return out

    def borrowed(self) -> int:
        """Table entries (within their unit's length) that hold a tile of another
        layer's slot: tables borrow tiles across layers."""
        units = len(self.layers) * self.hkv
        count = 0
        for layer, (local, batch) in enumerate(zip(self.local_tables, self.batches)):
            lens = batch.seq_lens.cpu().view(local.shape[0], self.hkv)
            bs = self.space.block_size
            for r in range(local.shape[0]):
                for h in range(self.hkv):
                    used = local[r, h, :-(-int(lens[r, h]) // bs)]
                    count += int(((used % units) // self.hkv != layer).sum())
        return count


def build_case(layout: str, backend: str, *, layers: int = 3, hkv: int = 2, group: int = 2,
               d: int = 64, bs: int = 16, num_blocks: int = 16, seed: int = 0,
               dtype: torch.dtype = torch.float32, device: str = "cpu",
               writer: Writer = index_writer) -> HeadPagedCase:
    """Write two requests, make their events, and build each layer's unit batch."""
    gen = torch.Generator().manual_seed(seed)
    caches = vllm_layer_caches(layout, layers, num_blocks, hkv, d, bs, dtype, device)
    space = TileSpace.from_layers(caches, backend)
    split = [c.transpose(1, 2).split(d, dim=-1) for c in caches]  # the backends' own split
    units = layers * hkv
    order = torch.randperm(num_blocks, generator=gen)
    requests = []
    for r, steps in enumerate(STEPS):
        total = sum(steps) + QUERY_TOKENS[r]
        n_blocks = -(-total // bs)
        block_ids, order = order[:n_blocks], order[n_blocks:]
        keys = torch.randn(layers, total, hkv, d, generator=gen).to(dtype)
        values = torch.randn(layers, total, hkv, d, generator=gen).to(dtype)

        def write(start: int, end: int, block_ids: torch.Tensor = block_ids,
                  keys: torch.Tensor = keys, values: torch.Tensor = values) -> None:
            pos = torch.arange(start, end)
            slots = (block_ids[pos // bs] * bs + pos % bs).to(device)
            for layer, (kc, vc) in enumerate(split):
                writer(keys[layer, start:end].to(device), values[layer, start:end].to(device),
                       kc, vc, slots)

        pages, seen = HeadPages.fresh(units, bs), 0
        for step in steps:
            write(seen, seen + step)
            seen += step
            pages, event = pages.plan_event(_random_keep(pages, seen, gen), seen)
            space.apply(event, block_ids)
        write(seen, total)
        requests.append(Request(block_ids, keys, values, pages, total))

    query_start_loc = torch.tensor([0, *torch.tensor(QUERY_TOKENS).cumsum(0).tolist()],
                                   dtype=torch.int32)
    query = torch.randn(int(query_start_loc[-1]), hkv * group, d, generator=gen).to(dtype)
    local_tables, batches = [], []
    for layer in range(layers):
        local_rows, tables, lengths = [], [], []
        for req in requests:
            local, length = req.pages.tables(req.total)
            rows = local[layer * hkv:(layer + 1) * hkv]
            local_rows.append(rows)
            tables.append(space.global_tiles(rows, req.block_ids))
            lengths.append(length[layer * hkv:(layer + 1) * hkv])
        width = max(t.shape[1] for t in tables)
        pad = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables]
        local_tables.append(torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[1]))
                                         for t in local_rows]))
        batches.append(unit_batch(query_start_loc, torch.stack(pad).to(device),
                                  torch.stack(lengths)))
    return HeadPagedCase(space, caches, requests, hkv, group, query_start_loc,
                         query.to(device), local_tables, batches)
