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

Error handling: shapes, dtypes and options are checked by the launchers and raise
``ValueError`` naming the argument. Values (``seq_lens`` against ``max_blocks *
block_size``) are checked by the torch path (unless ``validate=False``); the Triton kernels
clamp them to the table instead (they cannot raise).

This module is the public surface: the launchers live in one module per family,
``_scoring_ops.py`` (scoring, its checks and custom ops) and ``_compaction_ops.py``
(compaction, likewise), on ``_common.py`` (``BACKENDS``, ``HAS_TRITON``,
``resolve_backend``). Below them: ``_reference.py`` the torch paths,
``_triton_kernels.py`` the ``@triton.jit`` kernels, ``_launch.py`` their launches,
``_tuning.py`` their tiling, and ``_interpreter.py`` what lets the CPU CI run them under
``TRITON_INTERPRET=1``.
"""

from nexus_vllm.core.scoring import ATTENTION_REDUCES, KV_LAYOUTS
from nexus_vllm.kernels._common import BACKENDS, HAS_TRITON, resolve_backend
from nexus_vllm.kernels._compaction_ops import compact_block_tables
from nexus_vllm.kernels._interpreter import triton_interpret_enabled
from nexus_vllm.kernels._reference import (
    block_attention_mass_paged_batched,
    block_attention_mass_paged_torch,
    compact_block_tables_torch,
)
from nexus_vllm.kernels._scoring_ops import (
    block_attention_mass_paged,
    block_attention_mass_paged_layers,
)

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
