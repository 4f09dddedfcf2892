"""Typed launchers for the nexus-vllm kernels, registered as torch custom ops.

Public API (also exported by ``nexus_vllm.kernels``)
---------------------------------------------------
``block_attention_mass_paged(queries, key_cache, block_tables, seq_lens, *, kv_layout="NHD",
backend="auto", out=None, attention_reduce="mean") -> Tensor[R, W, max_blocks] float32``
    ``queries`` ``[R, W, Hq, D]`` (fp32/fp16/bf16); ``key_cache`` the K part of a paged cache,
    any strides, ``[num_blocks, block_size, Hkv, D]`` (``"NHD"``) or
    ``[num_blocks, Hkv, block_size, D]`` (``"HND"``), same dtype as ``queries``;
    ``block_tables`` ``[R, max_blocks]`` int32/int64 with each request's live (compacted)
    physical blocks in logical order; ``seq_lens`` ``[R]`` int32/int64 live token counts.
    ``out[r, i, j]`` is the softmax mass that window query ``i`` (live position
    ``seq_len - W + i``, causal) puts on the request's ``j``-th block, averaged over query
    heads: exactly ``nexus_vllm.core.block_attention_mass_paged`` per request. Entries with
    ``j >= ceil(seq_len / block_size)`` are 0. Rows whose position is negative
    (``i < W - seq_len``, i.e. a request shorter than the window) are all 0, so a request
    with ``seq_len == 0`` gives an all-zero slice; the other rows each sum to 1. With
    ``out`` (float32 ``[R, W, max_blocks]``) the result is *added* into it (one buffer for
    several layers) and ``out`` is returned. ``attention_reduce="max"`` takes the maximum over
    query heads of each head's block mass instead of their mean (rows then do not sum to
    1: the caller renormalises) and combines with ``out`` by the elementwise maximum
    instead of adding (mass is >= 0, so a zeroed ``out`` is the identity of both). A
    caller that splits heads or layers across ranks combines the ranks' results the same
    way: a sum (then divides) for ``"mean"``, a maximum (all-reduce with MAX) for
    ``"max"``.

``block_attention_mass_paged_layers(queries, key_caches, block_tables, seq_lens, *, ...)``
    The same over several layers of one batch (``queries`` ``[L, R, W, Hq, D]``, one key
    cache per layer), summed (``attention_reduce="max"``: their maximum): what the vLLM
    plugin calls once per eviction step. A composition of the op above (one launch per
    layer), except on the ``"batched"`` backend, which builds the batch's gather ids and
    mask once for all layers.

``compact_block_tables(block_tables, seq_lens, block_size, *, null_block=0, out_tables=None,
out_seq_lens=None, backend="auto", validate=True) -> (out_tables, out_seq_lens)``
    ``block_tables`` ``[R, max_blocks]`` (int32/int64) are *logical* block tables in which
    evicted blocks were replaced by ``null_block``; ``seq_lens`` ``[R]`` the logical token
    counts. Row ``r`` has ``n_r = ceil(seq_lens[r] / block_size)`` logical blocks; entries
    past ``n_r`` are ignored. Writes into ``out_tables`` (same shape and dtype as
    ``block_tables``) the non-null entries of the first ``n_r`` in order, then
    ``null_block`` up to ``max_blocks``; and into ``out_seq_lens`` (same shape/dtype as
    ``seq_lens``) ``seq_lens[r]`` minus the tokens the null entries held (``block_size``
    per null block; ``seq_len - j*block_size`` if block ``j`` is the partial last one).
    Output buffers are written in place (persistent buffers: safe for CUDA graphs) and must
    not overlap the inputs; if omitted they are allocated. ``validate=False`` skips the
    torch path's value check (a host read) for callers whose inputs are valid by
    construction (the vLLM plugin's per-step compaction): both paths then clamp.

``backend``: ``"triton"``, ``"torch"`` (the reference: ``core`` per request, always
available), ``"batched"`` (scoring only: the same math vectorised over requests in a few
large torch ops, what the vLLM plugin runs on CPU) or ``"auto"`` (Triton when the tensors
are on CUDA, or when ``TRITON_INTERPRET=1`` at launch time and Triton is installed; torch
otherwise, and also for scoring with a block size that is not a power of two >= 16).
The Triton and batched results match the torch one to float32 rounding (not bit for
bit); all are deterministic. Compaction treats ``"batched"`` as ``"torch"``.

Custom ops (what ``torch.compile`` sees; each has a fake implementation):
``torch.ops.nexus_vllm.block_attention_mass_paged(q, k, bt, sl, kv_layout, backend,
attention_reduce)`` (functional), ``torch.ops.nexus_vllm.block_attention_mass_paged_add_(q, k, bt,
sl, out, kv_layout, backend, attention_reduce)`` (mutates ``out``) and
``torch.ops.nexus_vllm.compact_block_tables(bt, sl, out_tables, out_seq_lens, block_size,
null_block, backend, validate)`` (mutates the two outputs).
This module has no ``from __future__ import annotations``: ``torch.library.custom_op``
infers the schemas from real annotations.

Error handling: shapes, dtypes and options are checked here and raise ``ValueError`` naming
the argument. Values (``seq_lens`` against ``max_blocks * block_size``) are checked by the
torch path (unless ``validate=False``); the Triton kernels clamp them to the table instead
(they cannot raise).

Where the rest lives: ``_reference.py`` the torch paths, ``_triton_kernels.py`` the
``@triton.jit`` kernels, ``_launch.py`` their launches, ``_tuning.py`` their tiling, and
``_interpreter.py`` what lets the CPU CI run them under ``TRITON_INTERPRET=1``.
"""

from collections.abc import Sequence

import torch

from nexus_vllm.core.scoring import ATTENTION_REDUCES, KV_LAYOUTS
from nexus_vllm.kernels._interpreter import triton_interpret_enabled
from nexus_vllm.kernels._launch import block_mass_triton, compact_triton
from nexus_vllm.kernels._reference import (
    block_attention_mass_paged_batched,
    block_attention_mass_paged_batched_layers,
    block_attention_mass_paged_torch,
    block_size_of,
    compact_block_tables_torch,
)

try:  # import guard: the package must import without triton (CPU-only installs)
    import triton  # noqa: F401

    HAS_TRITON = True
except (ImportError, OSError):  # pragma: no cover - missing or broken (no libtriton) install
    HAS_TRITON = False

__all__ = [
    "BACKENDS",
    "HAS_TRITON",
    "ATTENTION_REDUCES",
    "KV_LAYOUTS",
    "block_attention_mass_paged",
    "block_attention_mass_paged_batched",
    "block_attention_mass_paged_layers",
    "block_attention_mass_paged_torch",
    "compact_block_tables",
    "compact_block_tables_torch",
    "resolve_backend",
    "triton_interpret_enabled",
]

BACKENDS = ("auto", "triton", "torch", "batched")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int32, torch.int64)


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``backend`` (one of ``BACKENDS``) to the path that runs: ``"triton"``, ``"torch"``
    or ``"batched"`` (``"auto"`` picks as the module docstring says)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in ("torch", "batched"):
        return backend
    can_triton = HAS_TRITON and (device.type == "cuda" or triton_interpret_enabled())
    if backend == "triton":
        if not can_triton:
            raise ValueError(
                "backend='triton' needs triton and either CUDA tensors or TRITON_INTERPRET=1 "
                f"(triton installed: {HAS_TRITON}, device: {device})"
            )
        return "triton"
    return "triton" if can_triton else "torch"


# --------------------------------------------------------------------------------------
# Public launchers.
# --------------------------------------------------------------------------------------


def block_attention_mass_paged(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    backend: str = "auto",
    out: torch.Tensor | None = None,
    attention_reduce: str = "mean",
) -> torch.Tensor:
    """Attention mass of each request's window queries on each of its live KV blocks.

    Parameters
    ----------
    queries : Tensor[R, W, Hq, D] (float32, float16 or bfloat16)
        The W newest queries of each request (post-RoPE); query ``i`` sits at live
        position ``seq_lens[r] - W + i``.
    key_cache : Tensor[num_blocks, block_size, Hkv, D] (``"NHD"``) or
        Tensor[num_blocks, Hkv, block_size, D] (``"HND"``)
        The K part of a paged cache; any strides (e.g. a view of a fused K/V cache).
    block_tables : Tensor[R, max_blocks] (int32 or int64)
        Live (compacted) physical block ids of each request in logical order.
    seq_lens : Tensor[R] (int32 or int64)
        Live tokens per request; entries of ``block_tables`` past
        ``ceil(seq_len / block_size)`` are ignored.
    kv_layout : {"NHD", "HND"}
    backend : {"auto", "triton", "torch", "batched"}
    out : Tensor[R, W, max_blocks] (float32), optional
        If given, the result is combined into it (several layers into one buffer): added,
        or with ``attention_reduce="max"`` the elementwise maximum.
    attention_reduce : {"mean", "max"}
        How the query heads combine (``nexus_vllm.core.ATTENTION_REDUCES``).

    Returns
    -------
    Tensor[R, W, max_blocks] (float32)
        ``[r, i, j]``: mass query ``i`` of request ``r`` puts on its ``j``-th block,
        averaged over query heads (rows sum to 1), or their maximum; rows at negative
        positions (requests shorter than ``W``) are 0; columns past the request's block
        count are 0 (or unchanged in ``out``).
    """
    _check_mass_args(queries, key_cache, block_tables, seq_lens, kv_layout, backend, out,
                     attention_reduce)
    if out is None:
        return torch.ops.nexus_vllm.block_attention_mass_paged(
            queries, key_cache, block_tables, seq_lens, kv_layout, backend, attention_reduce
        )
    torch.ops.nexus_vllm.block_attention_mass_paged_add_(
        queries, key_cache, block_tables, seq_lens, out, kv_layout, backend, attention_reduce
    )
    return out


def block_attention_mass_paged_layers(
    queries: torch.Tensor,
    key_caches: Sequence[torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    backend: str = "auto",
    out: torch.Tensor | None = None,
    attention_reduce: str = "mean",
) -> torch.Tensor:
    """:func:`block_attention_mass_paged` over several layers of one batch, summed (with
    ``attention_reduce="max"``: the maximum over every layer and head).

    Parameters
    ----------
    queries : Tensor[L, R, W, Hq, D]
        Layer ``l``'s window queries, scored against ``key_caches[l]``.
    key_caches : sequence of L key caches
        Same shapes, dtype and layout as the single-layer op takes.
    block_tables, seq_lens, kv_layout, backend, out, attention_reduce
        As for :func:`block_attention_mass_paged`; shared by every layer.

    Returns
    -------
    Tensor[R, W, max_blocks] (float32)
        The sum over layers of the single-layer result (or their maximum), combined into
        ``out`` if given.
        The ``"batched"`` backend builds what depends only on the batch (gather ids,
        positions, the mask) once for all layers; the others run one launch per layer.
    """
    if queries.dim() != 5 or queries.shape[0] != len(key_caches):
        raise ValueError(f"queries must be [L={len(key_caches)}, R, W, Hq, D], got shape "
                         f"{tuple(queries.shape)}")
    # The shared arguments once; then only what can differ per layer (on the hot path).
    _check_mass_args(queries[0], key_caches[0], block_tables, seq_lens, kv_layout, backend, out,
                     attention_reduce)
    first = key_caches[0]
    for li, cache in enumerate(key_caches):
        if (cache.shape != first.shape or cache.dtype != first.dtype
                or cache.device != first.device):
            raise ValueError(
                f"key_caches[{li}] is {tuple(cache.shape)} {cache.dtype} on {cache.device}; "
                f"every layer must match key_caches[0]: {tuple(first.shape)} {first.dtype} "
                f"on {first.device}")
    if out is None:
        r, w = queries.shape[1:3]
        out = torch.zeros((r, w, block_tables.shape[1]), dtype=torch.float32,
                          device=queries.device)
    if resolve_backend(backend, queries.device) == "batched":
        block_attention_mass_paged_batched_layers(
            queries, key_caches, block_tables, seq_lens, out, kv_layout, attention_reduce
        )
        return out
    for q, cache in zip(queries, key_caches, strict=True):
        torch.ops.nexus_vllm.block_attention_mass_paged_add_(
            q, cache, block_tables, seq_lens, out, kv_layout, backend, attention_reduce
        )
    return out


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


def _check_mass_args(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_layout: str,
    backend: str,
    out: torch.Tensor | None,
    attention_reduce: str = "mean",
) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    if attention_reduce not in ATTENTION_REDUCES:
        raise ValueError(f"attention_reduce must be one of {ATTENTION_REDUCES}, got {attention_reduce!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if queries.dim() != 4:
        raise ValueError(f"queries must be [R, W, Hq, D], got shape {tuple(queries.shape)}")
    if queries.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"queries must be float32/float16/bfloat16, got {queries.dtype}")
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be 4-D, got shape {tuple(key_cache.shape)}")
    if key_cache.dtype != queries.dtype:
        raise ValueError(
            f"key_cache dtype {key_cache.dtype} must match queries dtype {queries.dtype}"
        )
    r, _, hq, d = queries.shape
    hkv = key_cache.shape[2] if kv_layout == "NHD" else key_cache.shape[1]
    if key_cache.shape[3] != d:
        raise ValueError(f"key_cache head size {key_cache.shape[3]} != queries head size {d}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key_cache KV heads ({hkv})")
    if block_tables.dim() != 2 or block_tables.shape[0] != r:
        raise ValueError(
            f"block_tables must be [R={r}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if block_tables.dtype not in _INT_DTYPES:
        raise ValueError(f"block_tables must be int32/int64, got {block_tables.dtype}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != r:
        raise ValueError(f"seq_lens must be [R={r}], got {tuple(seq_lens.shape)}")
    if seq_lens.dtype not in _INT_DTYPES:
        raise ValueError(f"seq_lens must be int32/int64, got {seq_lens.dtype}")
    for name, t in (
        ("key_cache", key_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
    ):
        if t.device != queries.device:
            raise ValueError(f"{name} is on {t.device} but queries on {queries.device}")
    if out is not None:
        want = (r, queries.shape[1], block_tables.shape[1])
        if tuple(out.shape) != want or out.dtype != torch.float32:
            raise ValueError(f"out must be float32 {want}, got {out.dtype} {tuple(out.shape)}")
        if out.device != queries.device:
            raise ValueError(f"out is on {out.device} but queries on {queries.device}")


def _check_compact_args(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    out_tables: torch.Tensor,
    out_seq_lens: torch.Tensor,
    backend: str,
) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if block_tables.dim() != 2 or block_tables.dtype not in _INT_DTYPES:
        raise ValueError(
            f"block_tables must be a 2-D int32/int64 tensor, got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}"
        )
    r = block_tables.shape[0]
    if seq_lens.dim() != 1 or seq_lens.shape[0] != r or seq_lens.dtype not in _INT_DTYPES:
        raise ValueError(
            f"seq_lens must be an int32/int64 [R={r}] tensor, got {seq_lens.dtype} "
            f"{tuple(seq_lens.shape)}"
        )
    if out_tables.shape != block_tables.shape or out_tables.dtype != block_tables.dtype:
        raise ValueError(
            f"out_tables must be {block_tables.dtype} {tuple(block_tables.shape)}, got "
            f"{out_tables.dtype} {tuple(out_tables.shape)}"
        )
    if out_seq_lens.shape != seq_lens.shape or out_seq_lens.dtype != seq_lens.dtype:
        raise ValueError(
            f"out_seq_lens must be {seq_lens.dtype} {tuple(seq_lens.shape)}, got "
            f"{out_seq_lens.dtype} {tuple(out_seq_lens.shape)}"
        )
    for name, t in (
        ("seq_lens", seq_lens),
        ("out_tables", out_tables),
        ("out_seq_lens", out_seq_lens),
    ):
        if t.device != block_tables.device:
            raise ValueError(f"{name} is on {t.device} but block_tables on {block_tables.device}")


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
# Custom ops (what torch.compile sees) and their fake implementations.
# --------------------------------------------------------------------------------------


def _mass_impl(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_layout: str,
    backend: str,
    accumulate: bool,
    attention_reduce: str,
) -> None:
    which = resolve_backend(backend, queries.device)
    if which == "batched":
        if not accumulate:
            out.zero_()
        block_attention_mass_paged_batched(
            queries, key_cache, block_tables, seq_lens, out, kv_layout, attention_reduce
        )
        return
    if which == "triton":
        bs = block_size_of(key_cache, kv_layout)
        if (bs >= 16 and (bs & (bs - 1)) == 0) or backend == "triton":
            block_mass_triton(
                queries, key_cache, block_tables, seq_lens, out, kv_layout, accumulate,
                attention_reduce == "max",
            )
            return
    # torch path (also "auto" with a block size the kernel does not take); mass is >= 0,
    # so a zeroed out is the identity of both the sum and the maximum.
    if not accumulate:
        out.zero_()
    block_attention_mass_paged_torch(queries, key_cache, block_tables, seq_lens, out, kv_layout,
                                     attention_reduce)


@torch.library.custom_op("nexus_vllm::block_attention_mass_paged", mutates_args=())
def _block_mass_op(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_layout: str,
    backend: str,
    attention_reduce: str,
) -> torch.Tensor:
    r, w = queries.shape[:2]
    out = torch.empty((r, w, block_tables.shape[1]), dtype=torch.float32, device=queries.device)
    _mass_impl(queries, key_cache, block_tables, seq_lens, out, kv_layout, backend, False,
               attention_reduce)
    return out


@_block_mass_op.register_fake
def _(queries, key_cache, block_tables, seq_lens, kv_layout, backend, attention_reduce):
    r, w = queries.shape[:2]
    return queries.new_empty((r, w, block_tables.shape[1]), dtype=torch.float32)


@torch.library.custom_op("nexus_vllm::block_attention_mass_paged_add_", mutates_args=("out",))
def _block_mass_add_op(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_layout: str,
    backend: str,
    attention_reduce: str,
) -> None:
    _mass_impl(queries, key_cache, block_tables, seq_lens, out, kv_layout, backend, True,
               attention_reduce)


@_block_mass_add_op.register_fake
def _(queries, key_cache, block_tables, seq_lens, out, kv_layout, backend, attention_reduce):
    return None


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
