"""Head-paged attention on vLLM's CPU cache with vLLM's stock kernel.

vLLM allocates every layer's KV cache as a view of one buffer (``allocate_kv_cache``,
vLLM 0.32 on CPU: layout ``LBHNC``), and the CPU backend stores each (block, KV head) as
one contiguous ``[2 x block_size, D]`` *tile* (keys, then values). Read the whole buffer
as ``[tiles, 1, 2 x block_size, D]`` and every tile of every layer has one id
(:class:`TileSpace`): a (request, layer, KV head) *unit* is then a sequence of one KV head
over its own tile table, and ``cpu_attention_with_kv_cache`` runs it unchanged with
``num_kv_heads = 1`` and the unit's GQA group as the query heads
(:func:`head_paged_attention`). Which tokens a unit holds, and the moves an event makes,
come from ``core/head_pages.py``; :class:`TileSpace` maps its local tile ids to these and
moves tokens whatever the kernel's layout inside a tile (:func:`cpu_token_offsets` finds
it with vLLM's own writer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nexus_vllm.core.head_pages import HeadPageEvent
from nexus_vllm.integration.compat.vllm_compat import cpu_attention_op

__all__ = ["TileSpace", "cpu_token_offsets", "head_paged_attention"]


@dataclass(frozen=True)
class TileSpace:
    """Every layer's CPU KV cache as one tensor of tiles.

    Attributes
    ----------
    tiles : Tensor[n_tiles, 1, 2 x block_size, D]
        The whole buffer; ``tiles[i]`` is one (layer, block, KV head).
    layer_base : LongTensor[L]
        The id of each layer's (block 0, head 0) tile.
    block_stride, head_stride : int
        Tile ids between consecutive blocks and KV heads of one layer.
    num_kv_heads, block_size, head_size : int
    """

    tiles: torch.Tensor
    layer_base: torch.Tensor
    block_stride: int
    head_stride: int
    num_kv_heads: int
    block_size: int
    head_size: int

    @classmethod
    def from_layers(cls, kv_caches: Sequence[torch.Tensor]) -> TileSpace:
        """The tile space of vLLM's CPU caches ``[num_blocks, Hkv, block_size, 2 x D]``,
        one per layer in unit order.

        Raises
        ------
        ValueError
            When the layers are not views of one buffer, or a (block, head) is not one
            contiguous tile: head granularity needs vLLM's layer-compact layouts.
        """
        first = kv_caches[0]
        _, hkv, bs, two_d = first.shape
        tile = bs * two_d
        storage = first.untyped_storage()
        for cache in kv_caches:
            s0, s1, s2, s3 = cache.stride()
            if cache.untyped_storage().data_ptr() != storage.data_ptr() or cache.shape != \
                    first.shape or cache.stride() != first.stride():
                raise ValueError("head granularity needs every layer's KV cache in one "
                                 "buffer with one shape (vLLM's allocate_kv_cache)")
            if (s1, s2, s3) != (tile, two_d, 1) or s0 % tile or cache.storage_offset() % tile:
                raise ValueError(
                    f"head granularity needs each (block, KV head) of the KV cache as one "
                    f"contiguous tile; the layout's strides are {cache.stride()}")
        n_tiles = storage.nbytes() // (tile * first.element_size())
        tiles = torch.empty(0, dtype=first.dtype, device=first.device).set_(
            storage, 0, (n_tiles, 1, 2 * bs, two_d // 2), (tile, tile, two_d // 2, 1))
        base = torch.tensor([c.storage_offset() // tile for c in kv_caches], dtype=torch.long)
        return cls(tiles, base, first.stride(0) // tile, 1, hkv, bs, two_d // 2)

    def key_value(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's ``key_cache`` and ``value_cache``: ``[n_tiles, 1, bs, D]`` views."""
        key, value = self.tiles.chunk(2, dim=2)
        return key, value

    def global_tiles(self, local: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Tile ids of local tile ids ``block_index x U + slot`` (``core/head_pages.py``)
        of a request whose logical block ``i`` is vLLM block ``block_ids[i]``; slot ``s``
        is layer ``s // Hkv``, head ``s % Hkv``."""
        units = int(self.layer_base.numel()) * self.num_kv_heads
        block = block_ids.long()[local // units]
        slot = local % units
        return (self.layer_base[slot // self.num_kv_heads] + block * self.block_stride
                + (slot % self.num_kv_heads) * self.head_stride)

    def apply(self, event: HeadPageEvent, block_ids: torch.Tensor,
              token_offsets: torch.Tensor) -> None:
        """Make ``event``'s moves in the cache, in place (token moves, then tile moves).

        ``token_offsets`` is ``[block_size, 2 x D]``: where each slot's key and value
        channels sit inside a tile (:func:`cpu_token_offsets`)."""
        flat = self.tiles.view(self.tiles.shape[0], -1)
        moves = event.token_moves
        if moves.numel():
            src = self.global_tiles(moves[:, 0], block_ids).view(-1, 1)
            dst = self.global_tiles(moves[:, 2], block_ids).view(-1, 1)
            flat[dst, token_offsets[moves[:, 3]]] = flat[src, token_offsets[moves[:, 1]]]
        if event.tile_moves.numel():
            src = self.global_tiles(event.tile_moves[:, 0], block_ids)
            dst = self.global_tiles(event.tile_moves[:, 1], block_ids)
            flat[dst] = flat[src]


_OFFSETS: dict[tuple[str, int, int, torch.dtype], torch.Tensor] = {}


def cpu_token_offsets(isa: str, head_size: int, block_size: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """LongTensor[block_size, 2 x D]: the element of a tile holding slot ``t``'s key
    channel ``d`` (column ``d``) and value channel ``d`` (column ``D + d``).

    Found once per configuration by writing marked tokens with vLLM's CPU cache writer
    (the kernels transpose keys inside a tile on some ISAs), so a layout change in a new
    vLLM release fails here instead of moving garbage."""
    key = (isa, head_size, block_size, dtype)
    if key in _OFFSETS:
        return _OFFSETS[key]
    writer = cpu_attention_op("cpu_attn_reshape_and_cache")
    bs, d = block_size, head_size

    def written(k_mark: torch.Tensor, v_mark: torch.Tensor) -> torch.Tensor:
        tile = torch.full((1, 1, 2 * bs, d), -1.0, dtype=dtype)
        kc, vc = tile.chunk(2, dim=2)
        writer(k_mark.to(dtype).reshape(bs, 1, d).contiguous(),
               v_mark.to(dtype).reshape(bs, 1, d).contiguous(), kc, vc,
               torch.arange(bs, dtype=torch.int64), isa, 1.0, 1.0, "auto")
        return tile.view(-1).float()

    # Small integers are exact in every cache dtype: one probe per coordinate.
    slots = torch.arange(bs, dtype=torch.float32).view(bs, 1).expand(bs, d)
    channels = torch.arange(d, dtype=torch.float32).view(1, d).expand(bs, d)
    slot_of = written(slots, slots)
    channel_of = written(channels, channels)
    is_value = written(torch.zeros(bs, d), torch.ones(bs, d))
    if bool((slot_of < 0).any()) or bool((is_value < 0).any()):
        raise RuntimeError(f"nexus-vllm: vLLM's CPU writer left part of a tile unwritten "
                           f"(isa={isa!r}); head-paged moves cannot read its layout")
    column = channel_of.long() + is_value.long() * d
    offsets = torch.full((bs, 2 * d), -1, dtype=torch.long)
    offsets[slot_of.long(), column] = torch.arange(2 * bs * d)
    if bool((offsets < 0).any()):
        raise RuntimeError(f"nexus-vllm: unknown CPU KV-cache tile layout (isa={isa!r})")
    _OFFSETS[key] = offsets
    return offsets


def head_paged_attention(query: torch.Tensor, output: torch.Tensor, space: TileSpace,
                         query_start_loc: torch.Tensor, tables: torch.Tensor,
                         lengths: torch.Tensor, *, scale: float, isa: str,
                         sliding_window: int = -1, softcap: float = 0.0) -> None:
    """One layer's attention with every (request, KV head) over its own tiles.

    Parameters
    ----------
    query : Tensor[T, Hq, D]
        The batch's queries, request by request (``query_start_loc``).
    output : Tensor[T, Hq, D]
        Written in place.
    space : TileSpace
    query_start_loc : IntTensor[R + 1]
    tables : LongTensor[R, Hkv, W]
        Each (request, KV head)'s tile ids in this layer's attention order; its newest
        ``query_len`` tokens are the request's queries (causal).
    lengths : LongTensor[R, Hkv]
        Tokens each (request, KV head) attends over, its queries included.
    """
    t, hq, d = query.shape
    r, hkv, width = tables.shape
    group = hq // hkv
    q_len = (query_start_loc[1:] - query_start_loc[:-1]).long()
    # Row of (request, head, token) in the per-unit batch -> (token, head) in the input.
    token = torch.repeat_interleave(torch.arange(t), hkv).view(t, hkv)
    request = torch.repeat_interleave(torch.arange(r), q_len)
    head = torch.arange(hkv).view(1, hkv)
    unit_start = (query_start_loc[:-1].long() * hkv).view(r, 1) + \
        q_len.view(r, 1) * torch.arange(hkv).view(1, hkv)  # [R, Hkv]
    in_request = torch.arange(t) - query_start_loc[:-1].long()[request]
    row = unit_start[request] + in_request.view(t, 1)  # [T, Hkv]
    order = torch.empty(t * hkv, dtype=torch.long)
    order[row.view(-1)] = (token * hkv + head).view(-1)
    grouped = query.view(t * hkv, group, d)[order]
    unit_out = torch.empty_like(grouped)
    unit_starts = torch.zeros(r * hkv + 1, dtype=torch.int32)
    unit_starts[1:] = torch.cumsum(q_len.repeat_interleave(hkv), 0)
    seq_lens = lengths.reshape(-1).to(torch.int32)
    key_cache, value_cache = space.key_value()
    metadata = cpu_attention_op("cpu_attn_get_scheduler_metadata")(
        num_reqs=r * hkv, num_heads=group, num_kv_heads=1, head_dim=d, seq_lens=seq_lens,
        dtype=query.dtype, query_start_loc=unit_starts, causal=True,
        sliding_window_size=sliding_window, isa=isa, enable_kv_split=False)
    cpu_attention_op("cpu_attention_with_kv_cache")(
        query=grouped, key_cache=key_cache, value_cache=value_cache, output=unit_out,
        query_start_loc=unit_starts, seq_lens=seq_lens, scale=scale, causal=True,
        alibi_slopes=None, sliding_window=sliding_window,
        block_table=tables.reshape(r * hkv, width).to(torch.int32), softcap=softcap,
        scheduler_metadata=metadata, s_aux=None)
    output.view(t * hkv, group, d)[order] = unit_out
