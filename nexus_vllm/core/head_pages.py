"""Head-paged storage of one sequence: which tokens each (layer, KV head) holds, where,
and the moves an eviction event makes.

A vLLM block names one block-sized region in every layer's cache, and that region holds
every KV head; read it as ``U = layers x KV heads`` *tiles* (``block_size`` tokens of one
(layer, head)). Tiles are fungible: the attention of a (layer, head) *unit* reads any
tiles through its own table (``integration/worker/head_attention.py`` runs vLLM's stock
kernel that way), so a request holding ``N`` vLLM blocks may hand its ``N x U`` tiles to
its units in any numbers. This module is the serving layout's reference: pure PyTorch on
one sequence, no vLLM.

Tile ids here are local to the sequence: ``block_index x U + slot``, where
``block_index`` is the index in the sequence's logical block list and ``slot`` one of the
block's ``U`` tiles (the worker maps slot ``s`` to layer ``s // Hkv``, head ``s % Hkv``).

The layout is:

* the *tail*: the logical blocks from ``tail_block`` on, where vLLM writes new tokens
  (one slot per token for every head). Every unit holds the tail whole, each in its own
  tile of the block (slot ``u`` for unit ``u``), at the tokens' logical offsets;
* the *packed* region: each unit's kept older tokens in whole tiles of its own, in any
  order (decode reads no positions: keys are stored after RoPE; a prefill chunk's causal
  rows fall in the tail, after every packed token).

An event (:meth:`HeadPages.plan_event`) turns every whole block before the newest token's
block into packed storage. Each unit keeps whole tiles: its own tiles with the most kept
tokens stay, the kept tokens of its other tiles fill their holes (moves are proportional
to what is evicted, never to what is kept); then whole tiles move out of the blocks that
are given back into free tiles of the blocks that stay, so the sequence holds
``ceil(packed tiles / U)`` blocks before its tail: exactly block granularity's memory
at the same budget (:func:`packable_budget_tiles`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .head_paged import forced_positions, select_head_units
from .scoring import cdiv

__all__ = ["HeadPages", "HeadPageEvent", "apply_head_page_event", "packable_budget_tiles",
           "select_packed", "tail_block_of"]


def tail_block_of(num_tokens: int, block_size: int) -> int:
    """The logical block holding the newest of ``num_tokens`` tokens (0 when none): the
    first block an event leaves in place."""
    return max(int(num_tokens) - 1, 0) // int(block_size)


def packable_budget_tiles(budget_blocks: int, num_tokens: int, block_size: int,
                          num_units: int) -> int:
    """Tiles the packed region may fill so that packed blocks plus the tail blocks stay
    within ``budget_blocks``: ``(budget_blocks - tail blocks) x U``, at least 0."""
    tail_blocks = cdiv(int(num_tokens), int(block_size)) - tail_block_of(num_tokens, block_size)
    return max(int(budget_blocks) - tail_blocks, 0) * int(num_units)


def select_packed(scores: torch.Tensor, live: torch.Tensor, budget_blocks: int,
                  block_size: int, *, positions: torch.Tensor, seen: int,
                  sink_blocks: int, recent_blocks: int, group: int = 1,
                  sampler: str = "topk", n: int = 1, generator: torch.Generator | None = None,
                  shares: torch.Tensor | None = None) -> torch.Tensor:
    """One event's choice under the serving layout: :func:`select_head_units` over the
    entries before the newest token's block, within :func:`packable_budget_tiles`; that
    block and any after it (the tail) kept whole by every head, and every head keeping
    the forced set (:func:`forced_positions`). The transformers path and the server both
    choose this way, so they keep the same entries.

    Parameters
    ----------
    scores : Tensor[L, Hkv, T]
    live : BoolTensor[L, Hkv, T]
    budget_blocks : int
        The sequence's block budget (tail blocks included).
    block_size : int
    positions : LongTensor[T]
        Each slot's logical position.
    seen : int
        Tokens fed.
    sink_blocks, recent_blocks : int
        The forced set's sinks and recent blocks.
    group, sampler, n, generator, shares
        As :func:`select_head_units`.

    Returns
    -------
    BoolTensor[L, Hkv, T]: a subset of ``live`` whose packed entries fill whole
    head-blocks (:meth:`HeadPages.plan_event` takes it as ``keep``).
    """
    packable = positions < tail_block_of(seen, block_size) * block_size
    out = live.bool().clone()
    if not bool(packable.any()):
        return out
    units = int(live.shape[0] * live.shape[1])
    budget = packable_budget_tiles(budget_blocks, seen, block_size, units)
    forced = forced_positions(positions, seen, block_size, sink_blocks, recent_blocks)
    out[..., packable] = select_head_units(
        scores[..., packable], out[..., packable], forced[packable], budget, block_size,
        positions=positions[packable], group=group, sampler=sampler, n=n,
        generator=generator, shares=shares)
    return out


@dataclass(frozen=True)
class HeadPageEvent:
    """What one event does to the cache, in local tile ids (``block x U + slot``).

    Apply ``token_moves`` first, then ``tile_moves``: a tile move's destination is never
    read by a token move, and no tile is both a source and a destination.

    Attributes
    ----------
    token_moves : LongTensor[M, 4]
        ``(src_tile, src_slot, dst_tile, dst_slot)``: one token of one unit, inside the
        unit's own tiles.
    tile_moves : LongTensor[K, 2]
        ``(src_tile, dst_tile)``: whole tiles, out of blocks given back.
    freed_blocks : LongTensor[F]
        Logical block indices the sequence gives back (none holds a kept token after the
        moves).
    """

    token_moves: torch.Tensor
    tile_moves: torch.Tensor
    freed_blocks: torch.Tensor


@dataclass(frozen=True)
class HeadPages:
    """One sequence's head-paged layout (immutable; an event returns a new one).

    Attributes
    ----------
    num_units : int
        Layers x KV heads (``U``); unit ``u`` is layer ``u // Hkv``, head ``u % Hkv``.
    block_size : int
    tail_block : int
        The first logical block of the tail (held whole by every unit, in place).
    unit_tiles : tuple of LongTensor[n_u]
        Each unit's packed tiles, in table order.
    unit_positions : tuple of LongTensor[n_u x block_size]
        The logical position of every token in those tiles, in table order.
    """

    num_units: int
    block_size: int
    tail_block: int
    unit_tiles: tuple[torch.Tensor, ...]
    unit_positions: tuple[torch.Tensor, ...]

    @classmethod
    def fresh(cls, num_units: int, block_size: int) -> HeadPages:
        """A sequence no event has touched: everything is tail (block granularity's
        layout, every unit in its own slot of every block)."""
        empty = torch.zeros(0, dtype=torch.long)
        return cls(int(num_units), int(block_size), 0, (empty,) * num_units,
                   (empty,) * num_units)

    def tail_tiles(self, num_tokens: int, unit: int) -> torch.Tensor:
        """Unit ``unit``'s tiles of the tail blocks holding ``num_tokens`` tokens."""
        blocks = torch.arange(self.tail_block, cdiv(int(num_tokens), self.block_size))
        return blocks * self.num_units + int(unit)

    def tables(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every unit's attention table and length at ``num_tokens`` tokens seen.

        Returns
        -------
        tiles : LongTensor[U, max_tiles]
            Packed tiles then tail tiles, padded with 0 past each unit's own.
        lengths : LongTensor[U]
            Tokens each unit attends over: its packed tokens plus the tail's.
        """
        rows = [torch.cat([self.unit_tiles[u], self.tail_tiles(num_tokens, u)])
                for u in range(self.num_units)]
        width = max((int(r.numel()) for r in rows), default=0)
        tiles = torch.zeros(self.num_units, width, dtype=torch.long)
        for u, row in enumerate(rows):
            tiles[u, :row.numel()] = row
        tail_tokens = max(int(num_tokens) - self.tail_block * self.block_size, 0)
        lengths = torch.tensor([int(p.numel()) + tail_tokens for p in self.unit_positions],
                               dtype=torch.long)
        return tiles, lengths

    def live(self, num_tokens: int) -> torch.Tensor:
        """BoolTensor[U, num_tokens]: the positions each unit holds."""
        out = torch.zeros(self.num_units, int(num_tokens), dtype=torch.bool)
        out[:, self.tail_block * self.block_size:] = True
        for u, positions in enumerate(self.unit_positions):
            out[u, positions] = True
        return out

    def blocks_held(self, num_tokens: int) -> torch.Tensor:
        """LongTensor: the logical blocks holding a packed tile or the tail, ascending."""
        packed = [t // self.num_units for t in self.unit_tiles]
        tail = torch.arange(self.tail_block, cdiv(int(num_tokens), self.block_size))
        return torch.unique(torch.cat([*packed, tail]))

    def plan_event(self, keep: torch.Tensor, num_tokens: int
                   ) -> tuple[HeadPages, HeadPageEvent]:
        """Pack every whole block before the newest token's block, keeping ``keep``.

        Parameters
        ----------
        keep : BoolTensor[U, num_tokens]
            The positions each unit keeps; a subset of :meth:`live`. Positions in the
            newest token's block and after are kept by every unit whatever ``keep`` says
            (they are the new tail). Before it, each unit must keep whole tiles: a
            multiple of ``block_size`` tokens (``select_head_units`` keeps whole
            head-blocks; a unit that keeps all it holds holds whole blocks).
        num_tokens : int
            Tokens seen; the sequence's logical blocks are ``ceil(num_tokens / block_size)``.

        Returns
        -------
        (HeadPages, HeadPageEvent)
            The layout after the event, and the moves that make it.

        Raises
        ------
        ValueError
            When ``keep`` is not a subset of what a unit holds, or a unit keeps a count
            that is not whole tiles.
        """
        bs, units = self.block_size, self.num_units
        new_tail = max(tail_block_of(num_tokens, bs), self.tail_block)
        edge = new_tail * bs
        keep = keep.bool()
        live = self.live(num_tokens)
        if keep.shape != live.shape:
            raise ValueError(f"keep must be [{units}, {num_tokens}]; got {tuple(keep.shape)}")
        if bool((keep[:, :edge] & ~live[:, :edge]).any()):
            raise ValueError("keep names positions a unit no longer holds")
        token_moves: list[torch.Tensor] = []
        survivors: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        for u in range(units):
            tiles, pos = self._own_tiles(u, new_tail)
            kept_mask = keep[u, pos.view(-1)].view(pos.shape)
            moves, tiles, pos = _fill_holes(tiles, pos, kept_mask, u, bs)
            token_moves.append(moves)
            survivors.append(tiles)
            positions.append(pos)
        before = self.blocks_held(num_tokens)
        before = before[before < new_tail]
        tile_moves, survivors = _gather_tiles(survivors, before, units)
        kept_blocks = torch.unique(torch.cat([t // units for t in survivors]))
        freed = before[~torch.isin(before, kept_blocks)]
        pages = HeadPages(units, bs, new_tail, tuple(survivors), tuple(positions))
        event = HeadPageEvent(torch.cat(token_moves).view(-1, 4), tile_moves, freed)
        return pages, event

    def _own_tiles(self, unit: int, new_tail: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit ``unit``'s tiles before ``new_tail`` and their positions ``[n, bs]``:
        its packed tiles, then its slot of every old tail block before ``new_tail``."""
        bs = self.block_size
        blocks = torch.arange(self.tail_block, new_tail)
        tiles = torch.cat([self.unit_tiles[unit], blocks * self.num_units + unit])
        tail_pos = (blocks.view(-1, 1) * bs + torch.arange(bs).view(1, -1))
        pos = torch.cat([self.unit_positions[unit].view(-1, bs), tail_pos])
        return tiles, pos


def apply_head_page_event(tiles: torch.Tensor, event: HeadPageEvent) -> None:
    """Apply ``event`` to ``tiles`` (``[n_tiles, block_size, ...]`` indexed by local tile
    id), in place: the reference the worker's moves on vLLM's cache are tested against."""
    m = event.token_moves
    if m.numel():
        tiles[m[:, 2], m[:, 3]] = tiles[m[:, 0], m[:, 1]]
    if event.tile_moves.numel():
        tiles[event.tile_moves[:, 1]] = tiles[event.tile_moves[:, 0]]


def _fill_holes(tiles: torch.Tensor, pos: torch.Tensor, kept: torch.Tensor, unit: int,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One unit's tiles with the most kept tokens stay; the kept tokens of the others
    move into their holes. Returns the moves ``[M, 4]``, the staying tiles and their
    positions (flat, table order)."""
    count = int(kept.sum())
    if count % block_size:
        raise ValueError(f"unit {unit} keeps {count} tokens before the tail, not whole "
                         f"head-blocks of {block_size}")
    n = count // block_size
    order = torch.argsort(kept.sum(dim=1), descending=True, stable=True)
    stay, leave = order[:n], order[n:]
    holes = torch.nonzero(~kept[stay])  # [M, 2]: (row in stay, slot)
    sources = torch.nonzero(kept[leave])  # [M, 2]: (row in leave, slot)
    new_pos = pos[stay].clone()
    new_pos[holes[:, 0], holes[:, 1]] = pos[leave][sources[:, 0], sources[:, 1]]
    moves = torch.stack([tiles[leave][sources[:, 0]], sources[:, 1],
                         tiles[stay][holes[:, 0]], holes[:, 1]], dim=1)
    return moves, tiles[stay], new_pos.view(-1)


def _gather_tiles(survivors: list[torch.Tensor], blocks: torch.Tensor, units: int
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Move whole surviving tiles so they fill the fewest blocks: the blocks holding
    the most survivors stay (lowest index first on ties), the survivors elsewhere move
    into their free tiles. Returns ``[K, 2]`` moves and each unit's tiles after them."""
    flat = torch.cat(survivors) if survivors else torch.zeros(0, dtype=torch.long)
    need = cdiv(int(flat.numel()), units)
    per_block = torch.bincount(flat // units, minlength=int(blocks.max()) + 1)[blocks] \
        if blocks.numel() else torch.zeros(0, dtype=torch.long)
    stay = blocks[torch.argsort(per_block, descending=True, stable=True)[:need]]
    stay_all = (stay.view(-1, 1) * units + torch.arange(units).view(1, -1)).view(-1)
    free = stay_all[~torch.isin(stay_all, flat)]
    moving = ~torch.isin(flat // units, stay)
    after = flat.clone()
    after[moving] = free[:int(moving.sum())]
    moves = torch.stack([flat[moving], after[moving]], dim=1)
    return moves, list(after.split([int(t.numel()) for t in survivors]))
