"""Typed launchers for the nexus-vllm kernels, registered as torch custom ops.

Public API (also exported by ``nexus_vllm.kernels``)
---------------------------------------------------
``block_attention_mass_paged(queries, key_cache, block_tables, seq_lens, *, kv_layout="NHD",
backend="auto", out=None) -> Tensor[R, W, max_blocks] float32``
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
    several layers) and ``out`` is returned.

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

``backend``: ``"triton"``, ``"torch"`` (reference fallback, always available) or ``"auto"``
(Triton when the tensors are on CUDA, or when ``TRITON_INTERPRET=1`` at launch time and
Triton is installed; torch otherwise, and also for scoring with a block size that is not a
power of two >= 16). The Triton scoring result matches the torch one to float32 rounding
(not bit for bit); both are deterministic.

Custom ops (what ``torch.compile`` sees; each has a fake implementation):
``torch.ops.nexus_vllm.block_attention_mass_paged(q, k, bt, sl, kv_layout, backend)``
(functional), ``torch.ops.nexus_vllm.block_attention_mass_paged_add_(q, k, bt, sl, out,
kv_layout, backend)`` (mutates ``out``) and ``torch.ops.nexus_vllm.compact_block_tables(bt, sl,
out_tables, out_seq_lens, block_size, null_block, backend, validate)`` (mutates the two
outputs).
This module has no ``from __future__ import annotations``: ``torch.library.custom_op``
infers the schemas from real annotations.

Error handling: shapes, dtypes and options are checked here and raise ``ValueError`` naming
the argument. Values (``seq_lens`` against ``max_blocks * block_size``) are checked by the
torch path (unless ``validate=False``); the Triton kernels clamp them to the table instead
(they cannot raise).
"""

import contextlib
import functools
import importlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

from nexus_vllm.core.scoring import block_attention_mass_paged as _core_mass_paged
from nexus_vllm.core.scoring import num_blocks_for

try:  # import guard: the package must import without triton (CPU-only installs)
    import triton  # noqa: F401

    HAS_TRITON = True
except (ImportError, OSError):  # pragma: no cover - missing or broken (no libtriton) install
    HAS_TRITON = False

__all__ = [
    "BACKENDS",
    "HAS_TRITON",
    "KV_LAYOUTS",
    "block_attention_mass_paged",
    "block_attention_mass_paged_torch",
    "compact_block_tables",
    "compact_block_tables_torch",
    "resolve_backend",
    "triton_interpret_enabled",
]

BACKENDS = ("auto", "triton", "torch")
KV_LAYOUTS = ("NHD", "HND")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int32, torch.int64)

# Kernel tuning: blocks per statistics chunk (register tile width) and output tile width.
_CHUNK = 16
_BLOCK_N = 64
_TILE_TOKENS = 32


def triton_interpret_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the Triton CPU interpreter (read at call time)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``backend`` (``"auto"``/``"triton"``/``"torch"``) to ``"triton"`` or ``"torch"``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    can_triton = HAS_TRITON and (device.type == "cuda" or triton_interpret_enabled())
    if backend == "triton":
        if not can_triton:
            raise ValueError(
                "backend='triton' needs triton and either CUDA tensors or TRITON_INTERPRET=1 "
                f"(triton installed: {HAS_TRITON}, device: {device})"
            )
        return "triton"
    return "triton" if can_triton else "torch"


_kernel_module: ModuleType | None = None
_kernel_module_interpreted = False


_stdlib_swaps: list[tuple[ModuleType, str, object, object]] | None = None


@contextlib.contextmanager
def _interpretable_triton_stdlib() -> Iterator[None]:
    """Let interpreted kernels call ``tl.sum``/``tl.cdiv``/... after a compiled-mode import.

    ``triton.language``'s own ``@jit`` helpers are decorated when triton is first imported
    (vLLM imports it early, without ``TRITON_INTERPRET``); compiled ``JITFunction`` helpers
    refuse to be called from an interpreted kernel. For the duration of an interpreted
    launch only, swap them for interpreted twins, then put the originals back.
    """
    global _stdlib_swaps
    if _stdlib_swaps is None:
        _stdlib_swaps = []
        try:  # triton internals: if they move, fall back to no swapping
            import triton.language as tl
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction
        except ImportError:  # pragma: no cover - depends on the triton version
            pass
        else:
            for mod in (tl, tl.standard, tl.math, tl.random):
                for name, obj in list(vars(mod).items()):
                    if isinstance(obj, JITFunction):
                        _stdlib_swaps.append((mod, name, obj, InterpretedFunction(obj.fn)))
    for mod, name, _, twin in _stdlib_swaps:
        setattr(mod, name, twin)
    try:
        yield
    finally:
        for mod, name, orig, _ in _stdlib_swaps:
            setattr(mod, name, orig)


def _launch_context() -> contextlib.AbstractContextManager[None]:
    return (
        _interpretable_triton_stdlib() if triton_interpret_enabled() else contextlib.nullcontext()
    )


def _kernels() -> ModuleType:
    """Import (or re-import) the ``@triton.jit`` module in the current interpret mode.

    ``triton.jit`` picks compiled vs interpreted at decoration time, so the module is
    reloaded if ``TRITON_INTERPRET`` changed since it was first imported.
    """
    global _kernel_module, _kernel_module_interpreted
    want = triton_interpret_enabled()
    if _kernel_module is None:
        _kernel_module = importlib.import_module("nexus_vllm.kernels._triton_kernels")
    elif _kernel_module_interpreted != want:
        _kernel_module = importlib.reload(_kernel_module)
    _kernel_module_interpreted = want
    return _kernel_module


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _block_size(key_cache: torch.Tensor, kv_layout: str) -> int:
    return int(key_cache.shape[1] if kv_layout == "NHD" else key_cache.shape[2])


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
) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
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
# Torch reference paths.
# --------------------------------------------------------------------------------------


def block_attention_mass_paged_torch(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_layout: str = "NHD",
) -> torch.Tensor:
    """Torch fallback: ``core.block_attention_mass_paged`` per request, added into ``out``.

    ``out`` is float32 ``[R, W, max_blocks]``; rows of requests shorter than the window and
    columns past each request's block count are left unchanged.
    """
    w = queries.shape[1]
    max_blocks = block_tables.shape[1]
    block_size = _block_size(key_cache, kv_layout)
    for r, seq_len in enumerate(seq_lens.tolist()):
        if seq_len < 0:
            raise ValueError(f"seq_lens[{r}] = {seq_len} is negative")
        n = num_blocks_for(seq_len, block_size)
        if n > max_blocks:
            raise ValueError(
                f"seq_lens[{r}] = {seq_len} needs {n} blocks but block_tables has {max_blocks}"
            )
        w_live = min(w, seq_len)
        if w_live == 0:
            continue
        mass = _core_mass_paged(
            queries[r, w - w_live :], key_cache, block_tables[r], seq_len, kv_layout=kv_layout
        )
        out[r, w - w_live :, :n] += mass
    return out


def compact_block_tables_torch(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    null_block: int,
    out_tables: torch.Tensor,
    out_seq_lens: torch.Tensor,
    validate: bool = True,
) -> None:
    """Vectorised torch compaction (a handful of ops, no Python loop over requests).

    With ``validate`` it checks the lengths fit the table (one host read) and touches
    only the columns that hold live blocks (``max(ceil(seq_len / block_size))``);
    without, it reads nothing back (the vLLM plugin's per-step path) and, like the Triton
    kernel, clamps each row's block count to the table.
    """
    r, max_blocks = block_tables.shape
    if r == 0:
        return
    seq = seq_lens.to(torch.int64)
    n = torch.div(seq + (block_size - 1), block_size, rounding_mode="floor")
    if validate:
        n_max, seq_min = (int(v) for v in torch.stack([n.max(), seq.min()]).tolist())
        if n_max > max_blocks or seq_min < 0:
            bad = int(torch.nonzero((n > max_blocks) | (seq < 0))[0, 0])
            raise ValueError(
                f"seq_lens[{bad}] = {int(seq[bad])} does not fit a block table of "
                f"{max_blocks} blocks of {block_size} tokens"
            )
    else:
        n = n.clamp_(0, max_blocks)
        n_max = max_blocks
    if n_max < max_blocks:
        out_tables[:, n_max:].fill_(null_block)
    if n_max == 0:
        out_seq_lens.copy_(seq_lens)
        return
    table = block_tables[:, :n_max]
    col = torch.arange(n_max, device=table.device)
    pad = col[None, :] >= n[:, None]  # past the request's blocks: ignored
    drop = table == null_block
    drop |= pad
    keep_count = n_max - drop.sum(dim=1)
    # Every null entry drops a full block, except a null partial last block.
    last = table.gather(1, (n - 1).clamp_(min=0)[:, None])[:, 0]
    short = (last == null_block) & (n > 0)
    dropped = (n - keep_count) * block_size - short * (n * block_size - seq)
    # Kept entry -> its compacted column; everything else -> a scratch column at the end.
    dest = (~drop).cumsum(dim=1).sub_(1).masked_fill_(drop, n_max)
    staged = torch.full((r, n_max + 1), null_block, dtype=table.dtype, device=table.device)
    staged.scatter_(1, dest, table)
    out_tables[:, :n_max].copy_(staged[:, :n_max])
    out_seq_lens.copy_(seq - dropped)


# --------------------------------------------------------------------------------------
# Triton launch paths.
# --------------------------------------------------------------------------------------


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
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
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
            "CHUNK": _CHUNK,
            "TILE": self.tile,
            "BPT": self.tile // self.block_size,
            "CHUNK_TILES": _CHUNK * self.block_size // self.tile,
            "UPCAST": self.upcast,
        }


def scoring_config(
    dtype: torch.dtype, w: int, hq: int, hkv: int, d: int, block_size: int, *, interpret: bool
) -> ScoringConfig:
    """Pick the partial kernel's tiling for ``W`` window rows, GQA ``hq/hkv`` heads of size ``d``."""
    group = hq // hkv
    tile = min(max(block_size, _TILE_TOKENS), _CHUNK * block_size)
    max_rows = (64 if dtype == torch.float32 else 128) * _TILE_TOKENS // tile
    w_p = _next_pow2(w)
    g_tile = max(1, min(group, max_rows // w_p))
    block_m = max(16, _next_pow2(g_tile * w_p))
    return ScoringConfig(
        block_size=block_size,
        w_p=w_p,
        d_p=max(16, _next_pow2(d)),
        g_tile=g_tile,
        head_tiles=-(-group // g_tile),
        block_m=block_m,
        tile=tile,
        upcast=dtype == torch.float32 or interpret,
        num_warps=8 if block_m >= 32 else 4,
    )


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _num_programs_target(device: torch.device) -> int:
    """Programs to aim for: a few per SM so one long request still fills the GPU."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return 4 * _sm_count(index)
    return 1  # interpreter: programs run one after another, fewer is faster


def _block_mass_triton(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_layout: str,
    accumulate: bool,
) -> None:
    with _launch_context():
        _block_mass_triton_launch(
            queries, key_cache, block_tables, seq_lens, out, kv_layout, accumulate
        )


def _block_mass_triton_launch(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_layout: str,
    accumulate: bool,
) -> None:
    k = _kernels()
    seq_lens = seq_lens.contiguous()  # the kernels index it with stride 1
    r, w, hq, d = queries.shape
    max_blocks = block_tables.shape[1]
    if r == 0 or w == 0 or max_blocks == 0:
        if not accumulate:
            out.zero_()
        return
    if kv_layout == "NHD":
        _, bs, hkv, _ = key_cache.shape
        s_kb, s_kt, s_kh, s_kd = key_cache.stride()
    else:
        _, hkv, bs, _ = key_cache.shape
        s_kb, s_kh, s_kt, s_kd = key_cache.stride()
    cfg = scoring_config(queries.dtype, w, hq, hkv, d, bs, interpret=triton_interpret_enabled())
    num_chunks = -(-max_blocks // _CHUNK)
    base_programs = r * hkv * cfg.head_tiles
    splits = max(1, min(num_chunks, -(-_num_programs_target(queries.device) // base_programs)))
    chunks_per_prog = -(-num_chunks // splits)
    splits = -(-num_chunks // chunks_per_prog)

    dev = queries.device
    partial = torch.empty((r, hq, cfg.w_p, max_blocks), dtype=torch.float32, device=dev)
    m_buf = torch.empty((r, hq, num_chunks, cfg.w_p), dtype=torch.float32, device=dev)
    l_buf = torch.empty_like(m_buf)
    k._block_mass_partial_kernel[(r, hkv * cfg.head_tiles, splits)](
        queries, key_cache, block_tables, seq_lens, partial, m_buf, l_buf,
        *queries.stride(),
        s_kb, s_kt, s_kh, s_kd,
        *block_tables.stride(),
        partial.stride(0), partial.stride(1), partial.stride(2),
        m_buf.stride(0), m_buf.stride(1), m_buf.stride(2),
        w, hq, hq // hkv, cfg.head_tiles, d, max_blocks, num_chunks, chunks_per_prog,
        math.log2(math.e) / math.sqrt(d),
        **cfg.partial_constexprs(), num_warps=cfg.num_warps,
    )  # fmt: skip
    k._block_mass_factor_kernel[(r, hq)](
        seq_lens, m_buf, l_buf,
        m_buf.stride(0), m_buf.stride(1), m_buf.stride(2),
        w, max_blocks,
        BS=bs, CHUNK=_CHUNK, W_P=cfg.w_p, C_TILE=max(1, min(64, 2048 // cfg.w_p)),
    )  # fmt: skip
    k._block_mass_combine_kernel[(r, -(-max_blocks // _BLOCK_N))](
        seq_lens, partial, m_buf, out,
        partial.stride(0), partial.stride(1), partial.stride(2),
        m_buf.stride(0), m_buf.stride(1), m_buf.stride(2),
        *out.stride(),
        w, hq, max_blocks, 1.0 / hq,
        BS=bs, CHUNK=_CHUNK, W_P=cfg.w_p, BLOCK_N=_BLOCK_N, ACCUMULATE=accumulate,
    )  # fmt: skip


def _compact_triton(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    null_block: int,
    out_tables: torch.Tensor,
    out_seq_lens: torch.Tensor,
) -> None:
    r, max_blocks = block_tables.shape
    if r == 0:
        return
    seq_lens = seq_lens.contiguous()  # the kernel indexes both with stride 1
    seq_out = out_seq_lens if out_seq_lens.is_contiguous() else torch.empty_like(seq_lens)
    with _launch_context():
        _kernels()._compact_block_tables_kernel[(r,)](
            block_tables, seq_lens, out_tables, seq_out,
            *block_tables.stride(), *out_tables.stride(),
            max_blocks, null_block,
            BS=block_size, BLOCK=min(1024, max(16, _next_pow2(max_blocks))),
        )  # fmt: skip
    if seq_out is not out_seq_lens:
        out_seq_lens.copy_(seq_out)


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
) -> None:
    which = resolve_backend(backend, queries.device)
    if which == "triton":
        bs = _block_size(key_cache, kv_layout)
        if (bs >= 16 and (bs & (bs - 1)) == 0) or backend == "triton":
            _block_mass_triton(
                queries, key_cache, block_tables, seq_lens, out, kv_layout, accumulate
            )
            return
    # torch path (also "auto" with a block size the kernel does not take)
    if not accumulate:
        out.zero_()
    block_attention_mass_paged_torch(queries, key_cache, block_tables, seq_lens, out, kv_layout)


@torch.library.custom_op("nexus_vllm::block_attention_mass_paged", mutates_args=())
def _block_mass_op(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_layout: str,
    backend: str,
) -> torch.Tensor:
    r, w = queries.shape[:2]
    out = torch.empty((r, w, block_tables.shape[1]), dtype=torch.float32, device=queries.device)
    _mass_impl(queries, key_cache, block_tables, seq_lens, out, kv_layout, backend, False)
    return out


@_block_mass_op.register_fake
def _(queries, key_cache, block_tables, seq_lens, kv_layout, backend):
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
) -> None:
    _mass_impl(queries, key_cache, block_tables, seq_lens, out, kv_layout, backend, True)


@_block_mass_add_op.register_fake
def _(queries, key_cache, block_tables, seq_lens, out, kv_layout, backend):
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
    if resolve_backend(backend, block_tables.device) == "triton":
        _compact_triton(block_tables, seq_lens, block_size, null_block, out_tables, out_seq_lens)
    else:
        compact_block_tables_torch(
            block_tables, seq_lens, block_size, null_block, out_tables, out_seq_lens, validate
        )


@_compact_op.register_fake
def _(block_tables, seq_lens, out_tables, out_seq_lens, block_size, null_block, backend,
      validate):
    return None


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
    backend : {"auto", "triton", "torch"}
    out : Tensor[R, W, max_blocks] (float32), optional
        If given, the result is added into it (several layers into one buffer).

    Returns
    -------
    Tensor[R, W, max_blocks] (float32)
        ``[r, i, j]``: mass query ``i`` of request ``r`` puts on its ``j``-th block,
        averaged over query heads; rows sum to 1, except rows at negative positions
        (requests shorter than ``W``) which are 0; columns past the request's block count
        are 0 (or unchanged in ``out``).
    """
    _check_mass_args(queries, key_cache, block_tables, seq_lens, kv_layout, backend, out)
    if out is None:
        return torch.ops.nexus_vllm.block_attention_mass_paged(
            queries, key_cache, block_tables, seq_lens, kv_layout, backend
        )
    torch.ops.nexus_vllm.block_attention_mass_paged_add_(
        queries, key_cache, block_tables, seq_lens, out, kv_layout, backend
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
    backend : {"auto", "triton", "torch"}
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
        block_tables, seq_lens, out_tables, out_seq_lens, block_size, int(null_block), backend,
        bool(validate),
    )
    return out_tables, out_seq_lens
