"""Kernel tiling (``_tuning``): the named tiles keep the values and the kernels' constraints."""

from __future__ import annotations

import pytest

from nexus_vllm.kernels._tuning import (
    COMPACT_MAX_TILE,
    COMPACT_MIN_TILE,
    FACTOR_MAX_CHUNKS,
    FACTOR_TILE_ELEMS,
    compact_tile,
    factor_chunk_tile,
)

# Padded window rows (powers of two), up to past the factor tile's element budget.
W_PADDED = [1, 2, 8, 16, 32, 64, 256, 2048, 4096]
# Table widths: empty, tiny, at and around the compaction tile's bounds.
TABLE_WIDTHS = [0, 1, 5, 16, 17, 1000, 1024, 1025, 5000]


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@pytest.mark.parametrize("w_p", W_PADDED)
def test_factor_chunk_tile(w_p):
    c_tile = factor_chunk_tile(w_p)
    assert c_tile == max(1, min(64, 2048 // w_p))  # the launcher's value before it was named
    assert _is_pow2(c_tile) and c_tile <= FACTOR_MAX_CHUNKS  # tl.arange needs a power of two
    assert c_tile * w_p <= max(FACTOR_TILE_ELEMS, w_p)


@pytest.mark.parametrize("max_blocks", TABLE_WIDTHS)
def test_compact_tile(max_blocks):
    block = compact_tile(max_blocks)
    assert block == min(1024, max(16, 1 << max(0, max_blocks - 1).bit_length()))  # as before
    assert _is_pow2(block) and COMPACT_MIN_TILE <= block <= COMPACT_MAX_TILE
    if max_blocks <= COMPACT_MAX_TILE:
        assert block >= max_blocks  # one step per row
