"""Typed launcher of the compaction kernel, registered as a torch custom op.

``compact_block_tables`` (exported by ``nexus_vllm.kernels.ops``, whose docstring has the
contract), its argument checks, and the custom op ``torch.ops.nexus_vllm.compact_block_tables``
that dispatches to the Triton launch (``_launch.py``) or the torch path (``_reference.py``).
This module has no ``from __future__ import annotations``: ``torch.library.custom_op``
infers the schema from real annotations.
"""

import torch

from nexus_vllm.kernels._common import (
    INT_DTYPES,
    check_backend,
    check_same_device,
    resolve_backend,
)
from nexus_vllm.kernels._launch import compact_triton
from nexus_vllm.kernels._reference import compact_block_tables_torch

__all__ = ["compact_block_tables"]


def compact_block_tables(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    *,
    null_block: int = 0,
    out_tables: torch.Tensor | None = None,
    out_seq_lens: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop null (evicted) entries from logical block tables and shorten the seq lens.

    Parameters
    ----------
    block_tables : Tensor[R, max_blocks] (int32 or int64)
        Logical block tables; evicted blocks hold ``null_block``. Entries past
        ``ceil(seq_lens[r] / block_size)`` are ignored.
    seq_lens : Tensor[R] (int32 or int64)
        Logical token counts (evicted tokens included).
    block_size : int
        Tokens per block.
    null_block : int
        The id that marks an evicted entry (vLLM's shared null block is 0).
    out_tables : Tensor[R, max_blocks], optional
        Persistent output (same dtype as ``block_tables``): the kept ids in order, then
        ``null_block``. Must not overlap the inputs.
    out_seq_lens : Tensor[R], optional
        Persistent output (same dtype as ``seq_lens``): live token counts.
    backend : {"auto", "triton", "torch", "batched"}  ("batched" compacts like "torch")
    validate : bool
        Check on the torch path that each ``seq_len`` fits the table (a host read);
        ``False`` clamps instead, as the Triton kernel always does.

    Returns
    -------
    (out_tables, out_seq_lens)
    """
    if out_tables is None:
        out_tables = torch.empty_like(block_tables)
    if out_seq_lens is None:
        out_seq_lens = torch.empty_like(seq_lens)
    _check_compact_args(block_tables, seq_lens, block_size, out_tables, out_seq_lens, backend)
    torch.ops.nexus_vllm.compact_block_tables(
        block_tables,
        seq_lens,
        out_tables,
        out_seq_lens,
        block_size,
        int(null_block),
        backend,
        bool(validate),
    )
    return out_tables, out_seq_lens


# --------------------------------------------------------------------------------------
# Argument checks (shapes/dtypes only: they must also work on fake tensors).
# --------------------------------------------------------------------------------------


def _check_compact_args(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    out_tables: torch.Tensor,
    out_seq_lens: torch.Tensor,
    backend: str,
) -> None:
    check_backend(backend)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if block_tables.dim() != 2 or block_tables.dtype not in INT_DTYPES:
        raise ValueError(
            f"block_tables must be a 2-D int32/int64 tensor, got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}"
        )
    r = block_tables.shape[0]
    if seq_lens.dim() != 1 or seq_lens.shape[0] != r or seq_lens.dtype not in INT_DTYPES:
        raise ValueError(
            f"seq_lens must be an int32/int64 [R={r}] tensor, got {seq_lens.dtype} "
            f"{tuple(seq_lens.shape)}"
        )
    for name, got, like in (
        ("out_tables", out_tables, block_tables),
        ("out_seq_lens", out_seq_lens, seq_lens),
    ):
        if got.shape != like.shape or got.dtype != like.dtype:
            raise ValueError(
                f"{name} must be {like.dtype} {tuple(like.shape)}, got "
                f"{got.dtype} {tuple(got.shape)}"
            )
    check_same_device(
        "block_tables", block_tables,
        ("seq_lens", seq_lens), ("out_tables", out_tables), ("out_seq_lens", out_seq_lens),
    )


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory ranges intersect (conservative: by extent)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def extent(t: torch.Tensor) -> tuple[int, int]:
        start = t.data_ptr()
        last = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) * t.element_size()
        return start, start + last + t.element_size()

    a0, a1 = extent(a)
    b0, b1 = extent(b)
    return a0 < b1 and b0 < a1


# --------------------------------------------------------------------------------------
# The custom op (what torch.compile sees) and its fake implementation.
# --------------------------------------------------------------------------------------


@torch.library.custom_op(
    "nexus_vllm::compact_block_tables", mutates_args=("out_tables", "out_seq_lens")
)
def _compact_op(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out_tables: torch.Tensor,
    out_seq_lens: torch.Tensor,
    block_size: int,
    null_block: int,
    backend: str,
    validate: bool,
) -> None:
    if _overlaps(out_tables, block_tables) or _overlaps(out_seq_lens, seq_lens):
        raise ValueError("out_tables/out_seq_lens must not overlap block_tables/seq_lens")
    if resolve_backend(backend, block_tables.device) == "triton":  # "batched" -> torch
        compact_triton(block_tables, seq_lens, block_size, null_block, out_tables, out_seq_lens)
    else:
        compact_block_tables_torch(
            block_tables, seq_lens, block_size, null_block, out_tables, out_seq_lens, validate
        )


@_compact_op.register_fake
def _(block_tables, seq_lens, out_tables, out_seq_lens, block_size, null_block, backend, validate):
    return None
