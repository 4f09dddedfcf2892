"""Head-blocks of vLLM 0.32's one-buffer KV cache as tiles with one id, per backend.

Where vLLM 0.32 puts a layer's keys and values
-----------------------------------------------
Every attention backend gets the same per-layer view. ``allocate_kv_cache``
(``v1/worker/utils.py``) allocates one int8 buffer and ``create_kv_cache_views``
(``v1/kv_cache_interface.py``) cuts it into one *logical* ``[B, H, N, C]`` view per layer
(blocks, KV heads, tokens, content), with ``C = 2 x D`` elements for an unquantized
``AttentionSpec`` (``state_content_size_bytes = (head_size + head_size_v) x dtype size``).
Layer ``l``'s block ``b`` starts at ``offset + l x layer_stride + b x block_stride``; the
order of ``[L, B, H, N, C]`` in memory is the resolved ``KVCacheLayout``
(``v1/kv_cache_layout.py``, ``compute_layout_strides``): ``LBNHC`` (legacy ``NHD``),
``LBHNC`` (``HND``), ``BLNHC``, ``BLHNC``, ``BHLNC``, ``LHBNC``.

- FLASH_ATTN (``flash_attn.py``, ``FlashAttentionImpl.forward``) and TRITON_ATTN
  (``triton_attn.py``) split the view as ``kv_cache.transpose(1, 2).split(head_size,
  dim=-1)``: keys and values are the two halves of one ``C`` row, ``key_cache`` and
  ``value_cache`` are ``[B, N, H, D]`` strided views ``D`` elements apart, read through
  their strides (``unified_attention`` passes ``k.stride(0..3)``; FA's paged KV reads
  batch/row/head strides). Neither declares ``supported_kv_cache_layouts`` (any layout).
- FLASHINFER (``flashinfer.py``) permutes the view to the physical order
  (``kv_cache.permute(*layout.layer_view_order)``) and splits ``C`` the same way; it reads
  ``HND`` or ``NHD`` pages. On SM100 it declares ``(LBHNC, BLHNC)`` only.
- CPU_ATTN (``cpu_attn.py``) declares ``(LBHNC,)`` and reads a (block, head)'s ``[N, C]``
  region as ``[2 x N, D]``: keys, then values, in an ISA-specific order
  (``head_attention.cpu_token_offsets``).
- With no backend declaring, vLLM takes ``_DEFAULT_LAYOUT_PREFERENCE``
  (``v1/attention/backends/utils.py``) whose first entry is ``LBNHC``: FLASH_ATTN and
  TRITON_ATTN, and FlashInfer before SM100, run ``NHD`` unless ``VLLM_KV_CACHE_LAYOUT``
  says otherwise (``resolve_kv_cache_layout``; ``HND`` is an alias of ``LBHNC``).

Which layouts a head-block can be addressed in
----------------------------------------------
A head-paged unit reads its tokens through a table of *tile ids* with ``num_kv_heads = 1``:
the kernel finds token ``n`` of table entry ``t`` at ``t x stride0 + n x stride1``. That
needs every (layer, block, KV head) to be a ``[N, C]`` tile with one token stride, every
tile starting at a multiple of one id stride, in every layer of the buffer. When ``H``
precedes ``N`` in memory (``LBHNC``, ``BLHNC``, ``BHLNC``, ``LHBNC``) a (layer, block,
head) is one contiguous ``[N, C]`` tile of ``S = N x C`` elements starting at a multiple
of ``S`` (the layer and block strides are multiples of ``S``, unpadded pages), so the
buffer is ``[n_tiles, 1, N, C]``: tile ``t`` at ``t x S``, its key rows at ``t x S + n x
C`` and its value rows ``D`` elements after them (not a fixed number of tiles: vLLM 0.32
stores a token's key and value side by side in one ``C`` row). Read as a layer cache with
one KV head, the stock backends' own split gives the kernels' views
(:meth:`TileSpace.key_value`).

When ``N`` precedes ``H`` (``LBNHC`` = ``NHD``, ``BLNHC``) a block's heads interleave
token by token: head ``h``'s tokens are ``H x C`` apart and no (block, head) is a tile.
One id per head-block would exist only with ids one ``C`` row apart, whose ranges overlap
(id ``t``'s token ``n + 1`` is id ``t + H``'s token ``n``), ids ``N`` times larger, and
cache tensors no kernel documents (FA3/FA4 and trtllm-gen describe the cache with TMA);
:meth:`TileSpace.from_layers` refuses them and names ``VLLM_KV_CACHE_LAYOUT=HND``. With
one KV head (per rank) every layout is addressable.

Moves inside a tile: CUDA backends store token ``n`` as row ``n`` (``[K | V]``, written by
``reshape_and_cache_flash``), so a token is the ``C`` elements of its row
(:func:`row_token_offsets`); the CPU kernel's order inside a tile is found with vLLM's own
writer (``head_attention.cpu_token_offsets``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nexus_vllm.core.head_pages import HeadPageEvent

__all__ = ["CUDA_BACKENDS", "TILE_BACKENDS", "TileSpace", "UnitBatch", "kv_layout_name",
           "row_token_offsets", "unit_batch"]

#: Backends whose kernels read a token as one ``[K | V]`` row of ``C`` (NHD-strided views).
CUDA_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")
TILE_BACKENDS = ("CPU_ATTN", *CUDA_BACKENDS)
# The layouts a head-block has one tile id in (H before N in memory).
_TILED_LAYOUTS = "LBHNC (VLLM_KV_CACHE_LAYOUT=HND), BLHNC, BHLNC or LHBNC"


def kv_layout_name(kv_caches: Sequence[torch.Tensor]) -> str:
    """The ``KVCacheLayout`` name of per-layer ``[B, H, N, C]`` views of one buffer, from
    their strides (the layer stride from the first two layers' offsets; ``L`` outermost
    with one layer). Dimensions of size 1 may read either way."""
    first = kv_caches[0]
    layer = (kv_caches[1].storage_offset() - first.storage_offset()
             if len(kv_caches) > 1 else first.numel() * max(first.stride()) + 1)
    strides = dict(zip("LBHNC", (layer, *first.stride())))
    name = "".join(sorted("LBHNC", key=lambda d: -strides[d]))
    alias = {"LBNHC": " (NHD)", "LBHNC": " (HND)"}.get(name, "")
    return name + alias


def row_token_offsets(block_size: int, head_size: int) -> torch.Tensor:
    """LongTensor[block_size, 2 x D]: the CUDA backends' tile, where slot ``t``'s key
    channel ``d`` is element ``t x 2D + d`` and its value channel ``t x 2D + D + d``."""
    return torch.arange(block_size * 2 * head_size).view(block_size, 2 * head_size)


@dataclass(frozen=True)
class TileSpace:
    """Every layer's KV cache as one tensor of (layer, block, KV head) tiles.

    Attributes
    ----------
    tiles : Tensor[n_tiles, 1, block_size, 2 x D]
        The whole buffer as one layer cache with one KV head (vLLM's logical ``[B, H, N,
        C]``); ``tiles[i]`` is one (layer, block, KV head).
    layer_base : LongTensor[L]
        The id of each layer's (block 0, head 0) tile.
    block_stride, head_stride : int
        Tile ids between consecutive blocks and KV heads of one layer.
    num_kv_heads, block_size, head_size : int
    backend : str
        Whose kernel reads the tiles: ``CPU_ATTN`` or one of :data:`CUDA_BACKENDS`.
    """

    tiles: torch.Tensor
    layer_base: torch.Tensor
    block_stride: int
    head_stride: int
    num_kv_heads: int
    block_size: int
    head_size: int
    backend: str = "CPU_ATTN"

    @classmethod
    def from_layers(cls, kv_caches: Sequence[torch.Tensor], backend: str = "CPU_ATTN"
                    ) -> TileSpace:
        """The tile space of vLLM's per-layer caches ``[num_blocks, Hkv, block_size,
        2 x D]`` (logical order, the layout's strides), one per layer in unit order.

        Raises
        ------
        ValueError
            When the layers are not views of one buffer with one shape, or a (layer,
            block, KV head) is not one contiguous tile at a multiple of the tile size
            (the layout, e.g. ``NHD``, interleaves a block's heads per token: head
            granularity needs ``VLLM_KV_CACHE_LAYOUT=HND`` or another H-before-N
            layout), or ``backend`` is not one this module knows.
        """
        if backend not in TILE_BACKENDS:
            raise ValueError(f"head granularity has no tile view for the {backend} "
                             f"attention backend (known: {', '.join(TILE_BACKENDS)})")
        first = kv_caches[0]
        _, hkv, bs, two_d = first.shape
        tile = bs * two_d
        storage = first.untyped_storage()
        for cache in kv_caches:
            if cache.untyped_storage().data_ptr() != storage.data_ptr() or cache.shape != \
                    first.shape or cache.stride() != first.stride():
                raise ValueError("head granularity needs every layer's KV cache in one "
                                 "buffer with one shape (vLLM's allocate_kv_cache)")
        s0, s1, s2, s3 = first.stride()
        rows = (s2 == two_d or bs == 1) and s3 == 1
        aligned = all(x % tile == 0 for x in
                      (s0, s1 if hkv > 1 else 0, *(c.storage_offset() for c in kv_caches)))
        if not (rows and aligned):
            raise ValueError(
                f"head granularity needs each (layer, block, KV head) of the KV cache as "
                f"one contiguous tile of block_size x 2D elements; the "
                f"{kv_layout_name(kv_caches)} layout (per-layer strides {first.stride()}) "
                f"does not store it so (NHD layouts interleave a block's KV heads token "
                f"by token): set VLLM_KV_CACHE_LAYOUT=HND, or use {_TILED_LAYOUTS}")
        n_tiles = storage.nbytes() // (tile * first.element_size())
        tiles = torch.empty(0, dtype=first.dtype, device=first.device).set_(
            storage, 0, (n_tiles, 1, bs, two_d), (tile, tile, two_d, 1))
        base = torch.tensor([c.storage_offset() // tile for c in kv_caches], dtype=torch.long)
        return cls(tiles, base, s0 // tile, s1 // tile if hkv > 1 else 1, hkv, bs,
                   two_d // 2, backend)

    def key_value(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The backend kernel's ``key_cache`` and ``value_cache`` over every tile, for
        ``num_kv_heads = 1`` (index them with :meth:`global_tiles`).

        - CPU_ATTN: ``[n_tiles, 1, bs, D]``, each tile read as ``[2 x bs, D]`` (keys, then
          values), as ``cpu_attn.py`` splits a layer cache.
        - FLASH_ATTN, TRITON_ATTN: ``[n_tiles, bs, 1, D]`` (``NHD`` with one head; the
          split ``kv_cache.transpose(1, 2).split(D, -1)`` of :attr:`tiles`, its size-1
          stride canonical as FA's TMA paths want).
        - FLASHINFER: ``[n_tiles, 1, bs, D]`` (``HND``: pass ``kv_layout="HND"``).
        """
        n, _, bs, two_d = self.tiles.shape
        d = two_d // 2
        if self.backend == "CPU_ATTN":
            key, value = self.tiles.view(n, 1, 2 * bs, d).chunk(2, dim=2)
            return key, value
        if self.backend == "FLASHINFER":
            key, value = self.tiles.split(d, dim=-1)
            return key, value
        size, stride = (n, bs, 1, d), (bs * two_d, two_d, d, 1)
        return (self.tiles.as_strided(size, stride, self.tiles.storage_offset()),
                self.tiles.as_strided(size, stride, self.tiles.storage_offset() + d))

    def token_offsets(self) -> torch.Tensor | None:
        """Where each slot's key and value channels sit in a tile when the backend fixes
        it (:func:`row_token_offsets` for the CUDA backends); None for CPU_ATTN, whose
        order depends on the ISA (``head_attention.cpu_token_offsets``)."""
        if self.backend == "CPU_ATTN":
            return None
        return row_token_offsets(self.block_size, self.head_size).to(self.tiles.device)

    def global_tiles(self, local: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Tile ids of local tile ids ``block_index x U + slot`` (``core/head_pages.py``)
        of a request whose logical block ``i`` is vLLM block ``block_ids[i]``; slot ``s``
        is layer ``s // Hkv``, head ``s % Hkv``."""
        units = int(self.layer_base.numel()) * self.num_kv_heads
        block = block_ids.to(local.device).long()[local // units]
        slot = local % units
        base = self.layer_base.to(local.device)
        return (base[slot // self.num_kv_heads] + block * self.block_stride
                + (slot % self.num_kv_heads) * self.head_stride)

    def apply(self, event: HeadPageEvent, block_ids: torch.Tensor,
              token_offsets: torch.Tensor | None = None) -> None:
        """Make ``event``'s moves in the cache, in place (token moves, then tile moves).

        ``token_offsets`` is ``[block_size, 2 x D]``: where each slot's key and value
        channels sit inside a tile (``cpu_token_offsets`` on CPU_ATTN, which needs it;
        the CUDA backends' row layout when omitted)."""
        if token_offsets is None:
            token_offsets = self.token_offsets()
            if token_offsets is None:
                raise ValueError("CPU_ATTN tiles need the token offsets of vLLM's CPU "
                                 "writer (head_attention.cpu_token_offsets)")
        flat = self.tiles.view(self.tiles.shape[0], -1)
        device = flat.device
        offsets = token_offsets.to(device)
        moves = event.token_moves.to(device)
        if moves.numel():
            src = self.global_tiles(moves[:, 0], block_ids).view(-1, 1)
            dst = self.global_tiles(moves[:, 2], block_ids).view(-1, 1)
            flat[dst, offsets[moves[:, 3]]] = flat[src, offsets[moves[:, 1]]]
        if event.tile_moves.numel():
            tile_moves = event.tile_moves.to(device)
            src = self.global_tiles(tile_moves[:, 0], block_ids)
            dst = self.global_tiles(tile_moves[:, 1], block_ids)
            flat[dst] = flat[src]


@dataclass(frozen=True)
class UnitBatch:
    """One layer's batch as (request, KV head) *units*, each a sequence of one KV head:
    what a stock kernel (or a backend's metadata builder) takes with ``num_kv_heads = 1``.

    Units run request by request, heads in order inside a request; a unit's rows are its
    request's query tokens, each with the ``G = Hq / Hkv`` query heads of its GQA group.

    Attributes
    ----------
    order : LongTensor[T x Hkv]
        Unit row ``i`` is row ``order[i]`` of ``query.view(T x Hkv, G, D)``.
    query_start_loc : IntTensor[R x Hkv + 1]
    seq_lens : IntTensor[R x Hkv]
    block_table : IntTensor[R x Hkv, W]
        Each unit's tile ids (:meth:`TileSpace.global_tiles`).
    max_query_len, max_seq_len : int
    """

    order: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_units(self) -> int:
        return int(self.seq_lens.numel())

    def gather(self, query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """``query`` ``[T, Hq, D]`` -> the units' queries ``[T x Hkv, G, D]``."""
        t, hq, d = query.shape
        return query.reshape(t * num_kv_heads, hq // num_kv_heads, d)[self.order]

    def scatter(self, unit_out: torch.Tensor, output: torch.Tensor) -> None:
        """Write the units' outputs ``[T x Hkv, G, D]`` into ``output`` ``[T, Hq, D]``."""
        rows = unit_out.shape[0]
        output.view(rows, -1, output.shape[-1])[self.order] = unit_out


def unit_batch(query_start_loc: torch.Tensor, tables: torch.Tensor,
               lengths: torch.Tensor) -> UnitBatch:
    """The unit batch of one layer.

    Parameters
    ----------
    query_start_loc : IntTensor[R + 1]
        The requests' query rows (CPU: lengths are read on the host).
    tables : LongTensor[R, Hkv, W]
        Each (request, KV head)'s tile ids in this layer's attention order; its newest
        ``query_len`` tokens are the request's queries (causal).
    lengths : LongTensor[R, Hkv]
        Tokens each (request, KV head) attends over, its queries included.
    """
    r, hkv, width = tables.shape
    device = tables.device
    qsl = query_start_loc.long().cpu()
    t = int(qsl[-1])
    q_len = qsl[1:] - qsl[:-1]
    # Unit row of (token, head) of the input: its unit's first row + its index in the request.
    request = torch.repeat_interleave(torch.arange(r), q_len)
    unit_start = (qsl[:-1] * hkv).view(r, 1) + q_len.view(r, 1) * torch.arange(hkv).view(1, hkv)
    in_request = torch.arange(t) - qsl[:-1][request]
    row = unit_start[request] + in_request.view(t, 1)  # [T, Hkv]
    order = torch.empty(t * hkv, dtype=torch.long)
    order[row.view(-1)] = torch.arange(t * hkv)
    starts = torch.zeros(r * hkv + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(q_len.repeat_interleave(hkv), 0)
    seq_lens = lengths.reshape(-1).to(torch.int32)
    return UnitBatch(order.to(device), starts.to(device), seq_lens.to(device),
                     tables.reshape(r * hkv, width).to(torch.int32),
                     int(q_len.max()) if r else 0,
                     int(seq_lens.max()) if seq_lens.numel() else 0)
