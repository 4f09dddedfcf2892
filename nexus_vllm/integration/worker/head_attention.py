"""Head-paged attention on vLLM's CPU cache with vLLM's stock kernel.

vLLM allocates every layer's KV cache as a view of one buffer (``allocate_kv_cache``,
vLLM 0.32 on CPU: layout ``LBHNC``), and the CPU backend stores each (block, KV head) as
one contiguous ``[2 x block_size, D]`` *tile* (keys, then values). Read the whole buffer
as tiles (each ``[2 x block_size, D]``) and every tile of every layer has one id
(:class:`TileSpace`): a (request, layer, KV head) *unit* is then a sequence of one KV head
over its own tile table, and ``cpu_attention_with_kv_cache`` runs it unchanged with
``num_kv_heads = 1`` and the unit's GQA group as the query heads
(:func:`head_paged_attention`). Which tokens a unit holds, and the moves an event makes,
come from ``core/head_pages.py``; :class:`TileSpace` maps its local tile ids to these and
moves tokens whatever the kernel's layout inside a tile (:func:`cpu_token_offsets` finds
it with vLLM's own writer). :class:`TileSpace` lives in ``head_tiles.py``, with the CUDA
backends' tile views, which layouts they can be read in, and the per-unit batch
(:func:`~nexus_vllm.integration.worker.head_tiles.unit_batch`) every kernel takes.
"""

from __future__ import annotations

import torch

from nexus_vllm.integration.compat.vllm_compat import cpu_attention_op
from nexus_vllm.integration.worker.head_tiles import TileSpace, unit_batch

__all__ = ["TileSpace", "cpu_token_offsets", "head_paged_attention"]


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
    if space.backend != "CPU_ATTN":
        raise ValueError(f"head_paged_attention runs vLLM's CPU kernel; the tiles are "
                         f"laid out for {space.backend}")
    hkv = tables.shape[1]
    batch = unit_batch(query_start_loc, tables, lengths)
    grouped = batch.gather(query, hkv)
    unit_out = torch.empty_like(grouped)
    key_cache, value_cache = space.key_value()
    metadata = cpu_attention_op("cpu_attn_get_scheduler_metadata")(
        num_reqs=batch.num_units, num_heads=grouped.shape[1], num_kv_heads=1,
        head_dim=query.shape[2], seq_lens=batch.seq_lens, dtype=query.dtype,
        query_start_loc=batch.query_start_loc, causal=True,
        sliding_window_size=sliding_window, isa=isa, enable_kv_split=False)
    cpu_attention_op("cpu_attention_with_kv_cache")(
        query=grouped, key_cache=key_cache, value_cache=value_cache, output=unit_out,
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, scale=scale,
        causal=True, alibi_slopes=None, sliding_window=sliding_window,
        block_table=batch.block_table, softcap=softcap, scheduler_metadata=metadata,
        s_aux=None)
    batch.scatter(unit_out, output)
