"""Tiling of the Triton kernels: compile-time constants and the launch-size heuristics.

Each value here becomes a ``tl.constexpr`` or a grid size in ``_launch.py``.
``benchmarks/kernels/aot_compile_check.py`` builds the kernels with these same values for
sm_90 and reports their registers and spills (``-v``); rerun it after changing one.
Pure Python and torch: no triton import.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from nexus_vllm.core.scoring import cdiv

# Blocks per statistics chunk: the partial kernel's register tile width, and the unit of
# the (max, sum) statistics that the factor kernel combines.
CHUNK = 16
# Output columns (blocks) per combine-kernel program.
BLOCK_N = 64
# Fewest tokens per ``tl.dot`` in the partial kernel (a bigger block is one block per dot).
TILE_TOKENS = 32

# Factor kernel (``C_TILE``): chunk statistics are read as [C_TILE, W_P] fp32 tiles.
FACTOR_TILE_ELEMS = 2048  # 16 floats a thread at 4 warps, for each of the max and sum tiles
FACTOR_MAX_CHUNKS = 64  # 1024 blocks per step covers most rows; more would be masked lanes

# Compaction kernel (``BLOCK``): table entries per step, a power of two (``tl.arange``).
COMPACT_MIN_TILE = 16  # small tables share one compiled variant instead of one per size
COMPACT_MAX_TILE = 1024  # one step up to 1024 blocks; wider tables loop, registers bounded


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def scoring_block_size_ok(block_size: int) -> bool:
    """Whether the scoring kernels take ``block_size``: a power of two >= 16."""
    return block_size >= 16 and (block_size & (block_size - 1)) == 0


def factor_chunk_tile(w_p: int) -> int:
    """``C_TILE`` of ``_block_mass_factor_kernel`` for ``w_p`` (padded) window rows."""
    return max(1, min(FACTOR_MAX_CHUNKS, FACTOR_TILE_ELEMS // w_p))


def compact_tile(max_blocks: int) -> int:
    """``BLOCK`` of ``_compact_block_tables_kernel`` for tables ``max_blocks`` wide."""
    return min(COMPACT_MAX_TILE, max(COMPACT_MIN_TILE, next_pow2(max_blocks)))


@dataclass(frozen=True)
class ScoringConfig:
    """Compile-time shape of ``_block_mass_partial_kernel`` for one problem shape.

    Chosen from register counts of ahead-of-time sm_90 builds
    (``benchmarks/kernels/aot_compile_check.py``): 32-token tiles (64 for 64-token blocks),
    up to 128 rows per program for 16-bit inputs (64 for fp32, whose exact-fp32 dot is
    heavier), halved for 64-token tiles, and 8 warps once a program has 32+ rows; none of
    these spill.
    """

    block_size: int
    w_p: int  # window rows, padded to a power of two
    d_p: int  # head size, padded to a power of two (>= 16 for tl.dot)
    g_tile: int  # query heads (of one KV head) per program
    head_tiles: int  # programs per KV head
    block_m: int  # rows per program, g_tile * w_p padded to >= 16
    tile: int  # tokens per tl.dot
    upcast: bool  # fp32 operands (fp32 input, or the interpreter whose bf16 dot is wrong)
    num_warps: int

    def __post_init__(self) -> None:
        if not scoring_block_size_ok(self.block_size):
            raise ValueError(
                f"backend='triton' needs a power-of-two block size >= 16, got {self.block_size}"
            )

    def partial_constexprs(self) -> dict[str, int | bool]:
        return {
            "BS": self.block_size,
            "D_P": self.d_p,
            "W_P": self.w_p,
            "G_TILE": self.g_tile,
            "BLOCK_M": self.block_m,
            "CHUNK": CHUNK,
            "TILE": self.tile,
            "BPT": self.tile // self.block_size,
            "CHUNK_TILES": CHUNK * self.block_size // self.tile,
            "UPCAST": self.upcast,
        }


def scoring_config(
    dtype: torch.dtype, w: int, hq: int, hkv: int, d: int, block_size: int, *, interpret: bool
) -> ScoringConfig:
    """Pick the partial kernel's tiling for ``W`` window rows, GQA ``hq/hkv`` heads of size ``d``."""
    group = hq // hkv
    tile = min(max(block_size, TILE_TOKENS), CHUNK * block_size)
    max_rows = (64 if dtype == torch.float32 else 128) * TILE_TOKENS // tile
    w_p = next_pow2(w)
    g_tile = max(1, min(group, max_rows // w_p))
    block_m = max(16, next_pow2(g_tile * w_p))
    return ScoringConfig(
        block_size=block_size,
        w_p=w_p,
        d_p=max(16, next_pow2(d)),
        g_tile=g_tile,
        head_tiles=cdiv(group, g_tile),
        block_m=block_m,
        tile=tile,
        upcast=dtype == torch.float32 or interpret,
        num_warps=8 if block_m >= 32 else 4,
    )


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def num_programs_target(device: torch.device) -> int:
    """Programs to aim for: a few per SM so one long request still fills the GPU."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return 4 * _sm_count(index)
    return 1  # interpreter: programs run one after another, fewer is faster
