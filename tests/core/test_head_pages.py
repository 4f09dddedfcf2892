"""The head-paged layout of one sequence (core/head_pages.py): tables, events and moves,
checked against a cache simulated token by token."""

from __future__ import annotations

import pytest
import torch

from nexus_vllm.core.head_paged import forced_positions, select_head_units
from nexus_vllm.core.head_pages import (
    HeadPages,
    apply_head_page_event,
    packable_budget_tiles,
    select_packed,
    tail_block_of,
)

# (units, block_size, tokens per step, steps)
SHAPES = [(1, 4, 7, 6), (6, 4, 5, 8), (9, 8, 13, 6), (4, 16, 40, 5)]
SEEDS = [0, 1, 2]
# A code no position reaches: a tile token holds unit * _CODE + position.
_CODE = 100_000


class SimulatedCache:
    """Local tiles ``[blocks x U, block_size]``; vLLM's writer puts token ``p`` of unit
    ``u`` in tile ``(p // bs) x U + u`` at slot ``p % bs``."""

    def __init__(self, units: int, block_size: int, max_blocks: int):
        self.units, self.block_size = units, block_size
        self.tiles = torch.full((max_blocks * units, block_size), -1, dtype=torch.long)

    def write(self, start: int, end: int) -> None:
        for p in range(start, end):
            for u in range(self.units):
                self.tiles[(p // self.block_size) * self.units + u, p % self.block_size] = \
                    u * _CODE + p

    def read(self, pages: HeadPages, num_tokens: int) -> list[torch.Tensor]:
        """Each unit's tokens through its table, in table order (codes)."""
        tiles, lengths = pages.tables(num_tokens)
        return [self.tiles[tiles[u]].view(-1)[:int(lengths[u])] for u in range(self.units)]


def _random_keep(pages: HeadPages, num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Whole tiles per unit of what it holds before the new tail, and all of the tail."""
    bs = pages.block_size
    edge = tail_block_of(num_tokens, bs) * bs
    live = pages.live(num_tokens)
    keep = torch.zeros_like(live)
    keep[:, edge:] = True
    for u in range(pages.num_units):
        held = torch.nonzero(live[u, :edge]).view(-1)
        n_tiles = int(torch.randint(0, held.numel() // bs + 1, (1,), generator=gen))
        pick = held[torch.randperm(held.numel(), generator=gen)[:n_tiles * bs]]
        keep[u, pick] = True
    return keep


def _expected(pages: HeadPages, num_tokens: int) -> list[torch.Tensor]:
    edge = pages.tail_block * pages.block_size
    return [u * _CODE + torch.cat([pages.unit_positions[u], torch.arange(edge, num_tokens)])
            for u in range(pages.num_units)]


def test_fresh_layout_is_block_granularity() -> None:
    pages = HeadPages.fresh(num_units=3, block_size=4)
    tiles, lengths = pages.tables(10)
    assert tiles.tolist() == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert lengths.tolist() == [10, 10, 10]
    assert pages.blocks_held(10).tolist() == [0, 1, 2]
    assert bool(pages.live(10).all())


@pytest.mark.parametrize("units,block_size,step,steps", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_events_keep_exactly_what_was_chosen(units: int, block_size: int, step: int,
                                             steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    max_blocks = (step * steps) // block_size + 2
    cache = SimulatedCache(units, block_size, max_blocks)
    pages = HeadPages.fresh(units, block_size)
    seen = 0
    for _ in range(steps):
        cache.write(seen, seen + step)
        seen += step
        keep = _random_keep(pages, seen, gen)
        held_before = set(pages.blocks_held(seen).tolist())
        evicted = int((pages.live(seen) & ~keep).sum())
        pages, event = pages.plan_event(keep, seen)
        apply_head_page_event(cache.tiles, event)
        # Every unit reads exactly what it kept, through its own table.
        assert torch.equal(pages.live(seen), keep)
        for got, want in zip(cache.read(pages, seen), _expected(pages, seen)):
            assert torch.equal(got, want)
        # Packed tiles are whole; the sequence holds ceil(packed tiles / U) blocks
        # before its tail, and gives back only blocks it held.
        packed = sum(int(t.numel()) for t in pages.unit_tiles)
        held = pages.blocks_held(seen)
        assert int((held < pages.tail_block).sum()) == -(-packed // units)
        assert set(event.freed_blocks.tolist()) <= held_before
        assert not set(event.freed_blocks.tolist()) & set(held.tolist())
        all_tiles = torch.cat(list(pages.unit_tiles))
        assert all_tiles.unique().numel() == all_tiles.numel()
        # Token moves fill holes: never more than what was evicted.
        assert event.token_moves.shape[0] <= evicted


def test_keeping_everything_moves_nothing() -> None:
    pages = HeadPages.fresh(num_units=4, block_size=4)
    pages, event = pages.plan_event(torch.ones(4, 13, dtype=torch.bool), 13)
    assert pages.tail_block == 3
    assert event.token_moves.numel() == 0 and event.tile_moves.numel() == 0
    assert event.freed_blocks.numel() == 0
    assert pages.tables(13)[0].tolist() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14],
                                            [3, 7, 11, 15]]


def test_uneven_units_share_the_blocks() -> None:
    """One unit keeps everything, the other nothing: the keeper's tiles spread over the
    other unit's slots, so the sequence holds half the blocks."""
    units, bs, n = 2, 4, 33
    keep = torch.zeros(units, n, dtype=torch.bool)
    keep[0] = True
    keep[:, 32:] = True
    cache = SimulatedCache(units, bs, 9)
    cache.write(0, n)
    pages, event = HeadPages.fresh(units, bs).plan_event(keep, n)
    apply_head_page_event(cache.tiles, event)
    assert pages.blocks_held(n).tolist() == [0, 1, 2, 3, 8]
    assert event.freed_blocks.tolist() == [4, 5, 6, 7]
    assert event.tile_moves.shape[0] == 4
    for got, want in zip(cache.read(pages, n), _expected(pages, n)):
        assert torch.equal(got, want)


def test_bad_keep_is_refused() -> None:
    pages = HeadPages.fresh(num_units=2, block_size=4)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[0, 0] = False  # 7 of unit 0's 8 tokens before the tail: not whole tiles
    with pytest.raises(ValueError, match="unit 0 keeps 7 tokens"):
        pages.plan_event(keep, 9)
    pages, _ = pages.plan_event(torch.ones(2, 9, dtype=torch.bool) & (torch.arange(9) >= 4), 9)
    with pytest.raises(ValueError, match="no longer holds"):
        pages.plan_event(torch.ones(2, 10, dtype=torch.bool), 10)
    with pytest.raises(ValueError, match="keep must be"):
        pages.plan_event(torch.ones(3, 10, dtype=torch.bool), 10)


@pytest.mark.parametrize("seed", SEEDS)
def test_threshold_selection_fits_the_block_budget(seed: int) -> None:
    """select_head_units over the packed region at packable_budget_tiles keeps the
    sequence within its block budget, by construction."""
    gen = torch.Generator().manual_seed(seed)
    layers, heads, bs, budget_blocks = 3, 2, 4, 5
    units = layers * heads
    pages = HeadPages.fresh(units, bs)
    seen = 0
    for _ in range(6):
        seen += int(torch.randint(3, 11, (1,), generator=gen))
        edge = tail_block_of(seen, bs) * bs
        live = pages.live(seen)
        scores = torch.rand(layers, heads, edge, generator=gen)
        forced = forced_positions(torch.arange(edge), edge + 1, bs, sink_blocks=1,
                                  recent_blocks=0)
        budget = packable_budget_tiles(budget_blocks, seen, bs, units)
        keep = torch.ones(units, seen, dtype=torch.bool)
        keep[:, :edge] = select_head_units(scores, live[:, :edge].view(layers, heads, edge),
                                           forced, budget, bs).view(units, edge)
        pages, _ = pages.plan_event(keep, seen)
        assert pages.blocks_held(seen).numel() <= budget_blocks


@pytest.mark.parametrize("residue", range(8))
@pytest.mark.parametrize("budget_blocks", [3, 6])
def test_head_pages_hold_block_granularitys_blocks_at_every_residue(residue: int,
                                                                    budget_blocks: int) -> None:
    """At every residue of the length modulo the block size, an event under
    select_packed leaves the sequence holding what block granularity holds at the same
    budget: min(budget, blocks of the sequence) vLLM blocks."""
    layers, heads, bs = 2, 3, 8
    units = layers * heads
    gen = torch.Generator().manual_seed(residue)
    for full_blocks in (1, budget_blocks, 3 * budget_blocks):
        seen = full_blocks * bs + residue
        if seen == 0:
            continue
        pages = HeadPages.fresh(units, bs)
        positions = torch.arange(seen)
        live = pages.live(seen).view(layers, heads, seen)
        keep = select_packed(torch.rand(layers, heads, seen, generator=gen), live,
                             budget_blocks, bs, positions=positions, seen=seen,
                             sink_blocks=1, recent_blocks=1)
        pages, _ = pages.plan_event(keep.view(units, seen), seen)
        assert pages.blocks_held(seen).numel() == min(budget_blocks, -(-seen // bs))
