"""vLLM 0.32's GPU attention metadata builders on our compacted metadata (CPU tensors).

The worker compacts evicted blocks out of ``CommonAttentionMetadata`` before a backend's
builder runs (``WorkerEvictionState.compact``). These tests pin what each GPU builder
does with the result, so a vLLM upgrade that changes it fails here, without a GPU:

- FlashAttention and Triton ``build()`` (bare builders holding only the attributes
  ``build()`` reads; on CPU ``get_flash_attn_version()`` is None, so FA's AOT scheduler
  is off) keep our persistent block table and lengths by reference and take
  ``max_seq_len`` as given. A new attribute read makes the bare builder raise.
- FlashInfer: ``flashinfer.py`` needs the ``flashinfer`` package, absent on CPU. With
  stub ``flashinfer*`` modules (for one test only) and a torch stand-in for its Triton
  ``_copy_page_indices_kernel``, ``_compute_flashinfer_kv_metadata`` runs on CPU. It is
  fed as ``build()`` feeds it (page counts from ``seq_lens_cpu_upper_bound``); the rest
  of ``build()`` (wrapper selection, ``plan()``) needs real FlashInfer and is not run.
  The TRT-LLM paths read the device table and ``seq_lens`` directly, as FA does.

Batches: the hand-made batch of ``test_worker_state`` plus seeded random ones.

Head-paged metadata (``integration/worker/head_tiles.py``): each layer's batch as
(request, KV head) units over one-KV-head tile views, rows = units, block table = each
unit's tile ids, lengths = each unit's kept tokens (``tests/integration/head_paged_case``:
three layers in one HND buffer, a decode request and a prefill chunk). The same three
builders take it and hold the tables and lengths given.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from tests.integration.conftest import HAS_VLLM
from tests.integration.fakes import BS, FakeRunner, common_metadata, make_state, scheduler_output

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

NULL = 0  # vLLM's null block id (nexus_vllm.integration.compat.vllm_compat.NULL_BLOCK_ID)
FLASHINFER_BACKEND = "vllm.v1.attention.backends.flashinfer"
# Physical block ids, sequence lengths and query lengths per request, and the plan's
# evicted logical block indices.
Batch = tuple[dict[str, list[int]], list[int], list[int], dict[str, tuple[int, ...]]]


@dataclass
class Case:
    """One step's batch: vLLM's metadata, ours, and what attention must see."""

    state: Any  # the WorkerEvictionState that compacted it
    logical: Any  # CommonAttentionMetadata as vLLM builds it (nulls in the table)
    compacted: Any  # the same after WorkerEvictionState.compact
    live: list[list[int]]  # live block ids of each row, in logical order
    live_lens: list[int]  # tokens attention reads per row


def _fixed_batch() -> Batch:
    """``test_worker_state``'s batch: rows a and c lose blocks, b keeps all."""
    phys = {"a": [3, 7, 8, 2, 5], "b": [9, 10], "c": [11, 12, 13, 14]}
    return phys, [4 * BS + 5, 2 * BS, 4 * BS], [5, 1, 1], {"a": (1, 2), "c": (1,)}


def _random_batch(seed: int) -> Batch:
    """2-4 requests, 1-8 blocks each, prefill chunks and decodes; only whole blocks
    behind the query chunk and after the sink are evicted, as the scheduler does."""
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(2, 5))
    ids = iter(rng.permutation(np.arange(1, 64)).tolist())  # unique, never the null block
    phys, seq, query, evict = {}, [], [], {}
    for r in range(rows):
        # Row 0 is long enough to always lose a block, so the batch is always compacted.
        nblk = int(rng.integers(4, 9)) if r == 0 else int(rng.integers(1, 9))
        n = (nblk - 1) * BS + int(rng.integers(1, BS + 1))
        q = 1 if r == 0 or rng.random() < 0.5 else int(rng.integers(1, n + 1))
        req = f"r{r}"
        phys[req] = [next(ids) for _ in range(nblk)]
        seq.append(n)
        query.append(q)
        evictable = list(range(1, (n - q) // BS))
        chosen = [j for j in evictable if rng.random() < 0.5]
        if r == 0 and not chosen:
            chosen = [evictable[0]]
        if chosen:
            evict[req] = tuple(chosen)
    return phys, seq, query, evict


@pytest.fixture(params=[None, 0, 1, 2, 3], ids=lambda s: "fixed" if s is None else f"seed{s}")
def case(request: pytest.FixtureRequest) -> Iterator[Case]:
    """A compacted batch, inside an armed step (as when vLLM calls the builders)."""
    from nexus_vllm.integration.protocol import StepPlan

    phys, seq, query, evict = (_fixed_batch() if request.param is None
                               else _random_batch(request.param))
    runner = FakeRunner(phys)
    state = make_state(runner, max_requests=max(4, len(phys)))
    step = state.begin_step(scheduler_output(), StepPlan(step_id=1, evict=evict))
    logical = common_metadata(runner, seq, query)
    compacted = state.compactor.compact(logical)
    live = [[b for j, b in enumerate(phys[r]) if j not in evict.get(r, ())] for r in phys]
    live_lens = [n - BS * len(evict.get(r, ())) for r, n in zip(phys, seq)]
    yield Case(state, logical, compacted, live, live_lens)
    state.end_step(step)


def _check_compaction_input(c: Case) -> None:
    """Guard: the builder is given new, compacted values (else the contract is vacuous)."""
    assert c.compacted is not c.logical
    assert c.compacted.seq_lens_cpu_upper_bound.tolist() == c.live_lens
    assert c.compacted.max_seq_len == max(c.live_lens)


def _check_by_reference(m: Any, c: Case) -> None:
    """The builder's metadata holds our persistent buffers and compacted values."""
    assert m.seq_lens is c.compacted.seq_lens
    assert m.block_table is c.compacted.block_table_tensor
    assert m.max_seq_len == c.compacted.max_seq_len == max(c.live_lens)
    # The same storage as the state's persistent buffers (what a FULL graph would replay).
    assert m.block_table.data_ptr() == c.state.compactor._tables.data_ptr()
    assert m.seq_lens.data_ptr() == c.state.compactor._lens.data_ptr()
    assert m.seq_lens.tolist() == c.live_lens
    for row, ids in enumerate(c.live):
        assert m.block_table[row, : len(ids)].tolist() == ids


# -- FlashAttention ---------------------------------------------------------------------
def _flash_attn_builder() -> Any:
    """A ``FlashAttentionMetadataBuilder`` as ``__init__`` leaves it on a non-FA3, no-DCP,
    no-FULL-graph, text-only config: just the attributes ``build()`` reads."""
    from vllm.v1.attention.backends.flash_attn import (
        FlashAttentionMetadataBuilder,
        get_flash_attn_version,
    )

    assert get_flash_attn_version() is None  # CPU: no FA, so no AOT scheduler metadata
    b = object.__new__(FlashAttentionMetadataBuilder)
    b.aot_schedule = False
    b.aot_sliding_window = None  # filled on the first build()
    b.use_full_cuda_graph = False
    b.max_cudagraph_size = None
    b.max_num_splits = 0
    b.scheduler_metadata = None
    b.dcp_world_size = 1
    b.mm_prefix_query_ranges_np = None
    b.rswa_window = None
    return b


def test_flash_attn_build_keeps_compacted_buffers(case: Case) -> None:
    """FA ``build()`` passes our table and lengths through by reference (no copy a later
    compaction would miss) and takes the compacted ``max_seq_len``."""
    _check_compaction_input(case)
    m = _flash_attn_builder().build(0, case.compacted)
    _check_by_reference(m, case)
    assert m.scheduler_metadata is None


# -- Triton -----------------------------------------------------------------------------
def _triton_builder() -> Any:
    """A ``TritonAttentionMetadataBuilder`` with just the attributes ``build()`` reads
    (scratch buffers are tiny: the builder only hands them on)."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

    b = object.__new__(TritonAttentionMetadataBuilder)
    b.seq_threshold_3D = 8
    b.num_par_softmax_segments = 16
    b.softmax_segm_output = torch.empty(8, 4, 16, 64)
    b.softmax_segm_max = torch.empty(8, 4, 16)
    b.softmax_segm_expsum = torch.empty(8, 4, 16)
    b.max_seqs_64_segments = 0  # not SM120
    b.rswa_window = None
    b.device = torch.device("cpu")
    return b


def test_triton_build_keeps_compacted_buffers(case: Case) -> None:
    """Triton ``build()`` passes our table and lengths through by reference and takes
    the compacted ``max_seq_len``."""
    _check_compaction_input(case)
    m = _triton_builder().build(0, case.compacted)
    _check_by_reference(m, case)


# -- FlashInfer -------------------------------------------------------------------------
# What flashinfer.py imports from the flashinfer package (vLLM 0.32).
_FLASHINFER_NAMES = {
    "flashinfer": ("BatchAttentionWithAttentionSinkWrapper",
                   "BatchDecodeWithPagedKVCacheWrapper",
                   "BatchPrefillWithPagedKVCacheWrapper",
                   "BatchPrefillWithRaggedKVCacheWrapper", "get_seq_lens",
                   "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping"),
    "flashinfer.decode": ("fast_decode_plan", "trtllm_batch_decode_with_kv_cache"),
    "flashinfer.prefill": ("trtllm_batch_context_with_kv_cache",),
    "flashinfer.utils": ("FP4Tensor",),
}


def _unavailable(name: str) -> Any:
    """A function or class (for the names flashinfer.py uses in annotations and
    ``isinstance``) that fails if called: these tests run no FlashInfer kernel."""

    def stub(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"stub {name} called: this test runs no FlashInfer kernel")

    short = name.rsplit(".", 1)[1]
    return type(short, (), {"__init__": stub}) if short[0].isupper() else stub


class _CopyPageIndices:
    """Torch stand-in for vLLM's Triton ``_copy_page_indices_kernel``: program ``r``
    copies ``cu[r+1] - cu[r]`` ids from ``block_table``'s row ``r`` (raw pointer
    arithmetic with the given row stride, as the kernel does) to ``pages[cu[r]:]``."""

    def __getitem__(self, grid: tuple[int]) -> Any:
        def launch(pages: torch.Tensor, block_table: torch.Tensor, stride: int,
                   cu: torch.Tensor, BLOCK_SIZE: int) -> None:  # noqa: N803 (kernel's name)
            for r in range(grid[0]):
                start, end = int(cu[r]), int(cu[r + 1])
                row = torch.as_strided(block_table, (end - start,), (1,),
                                       block_table.storage_offset() + r * stride)
                pages[start:end] = row

        return launch


@pytest.fixture
def flashinfer_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """vLLM's ``flashinfer`` backend module, imported over stub ``flashinfer*`` modules;
    the stubs and the module leave ``sys.modules`` after the test."""
    for name, attrs in _FLASHINFER_NAMES.items():
        mod = types.ModuleType(name)
        # A spec, so vLLM's importlib.util.find_spec("flashinfer...") probes do not raise.
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None,
                                                      is_package=name == "flashinfer")
        for attr in attrs:
            setattr(mod, attr, _unavailable(f"{name}.{attr}"))
        monkeypatch.setitem(sys.modules, name, mod)
    for name in _FLASHINFER_NAMES:
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(sys.modules[parent], child, sys.modules[name])
    monkeypatch.delitem(sys.modules, FLASHINFER_BACKEND, raising=False)
    backends = importlib.import_module("vllm.v1.attention.backends")
    had_attr = hasattr(backends, "flashinfer")
    try:
        module = importlib.import_module(FLASHINFER_BACKEND)
        monkeypatch.setattr(module, "_copy_page_indices_kernel", _CopyPageIndices())
        yield module
    finally:
        # The import bound the module into sys.modules and onto its package: undo both
        # so later tests see FlashInfer as absent again.
        sys.modules.pop(FLASHINFER_BACKEND, None)
        if not had_attr and hasattr(backends, "flashinfer"):
            delattr(backends, "flashinfer")


@dataclass
class Pages:
    """FlashInfer's paged-KV description of a batch."""

    pages: list[list[int]]  # page ids of each request
    indptr: list[int]
    last_page_len: list[int]


def _flashinfer_pages(module: types.ModuleType, table: torch.Tensor,
                      upper: torch.Tensor, num_reqs: int, page_size: int = BS) -> Pages:
    """``_compute_flashinfer_kv_metadata`` on a bare builder, fed as ``build()`` feeds
    it without speculative decoding: lengths from ``seq_lens_cpu_upper_bound``, page
    counts ``ceil(len / page_size)``, indices from the block table."""
    from vllm.v1.utils import CpuGpuBuffer

    b = object.__new__(module.FlashInferMetadataBuilder)
    cpu = torch.device("cpu")
    b.paged_kv_indptr = CpuGpuBuffer(num_reqs + 1, dtype=torch.int32, device=cpu,
                                     pin_memory=False)
    # -1, not 0: a page the kernel never wrote must not pass for the null block.
    b.paged_kv_indices = torch.full((table.numel(),), -1, dtype=torch.int32)
    b.paged_kv_last_page_len = CpuGpuBuffer(num_reqs, dtype=torch.int32, device=cpu,
                                            pin_memory=False)
    seq_lens_np = upper.numpy()
    num_blocks_np = (seq_lens_np + (page_size - 1)) // page_size
    flat = b._compute_flashinfer_kv_metadata(num_blocks_np, seq_lens_np, table, num_reqs,
                                             page_size)
    indptr = b.paged_kv_indptr.gpu[: num_reqs + 1].tolist()
    pages = [flat[indptr[r]: indptr[r + 1]].tolist() for r in range(num_reqs)]
    return Pages(pages, indptr, b.paged_kv_last_page_len.gpu[:num_reqs].tolist())


def test_flashinfer_pages_are_the_live_blocks(case: Case,
                                              flashinfer_backend: types.ModuleType) -> None:
    """From the compacted metadata, each request's pages are exactly its live blocks in
    order (never the null block); indptr counts them; last-page fill is unchanged."""
    c = case
    _check_compaction_input(c)
    got = _flashinfer_pages(flashinfer_backend, c.compacted.block_table_tensor,
                            c.compacted.seq_lens_cpu_upper_bound, c.compacted.num_reqs)
    assert got.pages == c.live
    assert all(NULL not in p for p in got.pages)
    assert got.indptr == [0, *np.cumsum([len(ids) for ids in c.live]).tolist()]
    # Whole blocks are evicted, so the partial last block keeps its fill.
    assert got.last_page_len == [(n - 1) % BS + 1 for n in c.live_lens]
    logical = c.logical.seq_lens_cpu_upper_bound.tolist()
    assert got.last_page_len == [(n - 1) % BS + 1 for n in logical]


def test_flashinfer_logical_upper_bound_pulls_in_null_block(
        case: Case, flashinfer_backend: types.ModuleType) -> None:
    """Why compaction must rewrite the CPU upper bound: the compacted table with the
    logical ``seq_lens_cpu_upper_bound`` gives every evicting request its live blocks
    followed by one null block 0 per evicted block (attention would read block 0)."""
    c = case
    _check_compaction_input(c)
    got = _flashinfer_pages(flashinfer_backend, c.compacted.block_table_tensor,
                            c.logical.seq_lens_cpu_upper_bound, c.compacted.num_reqs)
    logical_blocks = [-(-n // BS) for n in c.logical.seq_lens_cpu_upper_bound.tolist()]
    evicting = 0
    for pages, ids, nblk in zip(got.pages, c.live, logical_blocks):
        assert pages == ids + [NULL] * (nblk - len(ids))
        evicting += nblk > len(ids)
    assert evicting > 0


# -- Head-paged metadata ----------------------------------------------------------------
@pytest.fixture(scope="module")
def head_case() -> Any:
    """A head-paged batch on an HND (LBHNC) buffer: three layers, two KV heads, tables
    that borrow tiles across layers."""
    from tests.integration.head_paged_case import build_case

    case = build_case("LBHNC", "FLASH_ATTN", seed=1)
    assert case.borrowed() > 0
    return case


def _head_metadata(batch: Any) -> Any:
    """``CommonAttentionMetadata`` of one layer's unit batch, as the worker would hand it
    to the builders (CPU tensors)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    rows = int(batch.order.numel())
    return CommonAttentionMetadata(
        query_start_loc=batch.query_start_loc,
        query_start_loc_cpu=batch.query_start_loc.clone(), seq_lens=batch.seq_lens,
        num_reqs=batch.num_units, num_actual_tokens=rows,
        max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        block_table_tensor=batch.block_table,
        slot_mapping=torch.zeros(rows, dtype=torch.int64),
        seq_lens_cpu_upper_bound=batch.seq_lens.clone())


def _check_head_metadata(m: Any, batch: Any, case: Any) -> None:
    assert m.block_table is batch.block_table
    assert m.seq_lens is batch.seq_lens
    assert m.query_start_loc is batch.query_start_loc
    assert m.max_seq_len == batch.max_seq_len
    assert m.max_query_len == max(case.query_start_loc.diff().tolist())
    assert m.num_actual_tokens == case.query.shape[0] * case.hkv
    # One row per (request, KV head): the decode request's units, then the chunk's.
    assert batch.query_start_loc.diff().tolist() == [1] * case.hkv + [7] * case.hkv


@pytest.mark.parametrize("layer", [0, 2])
def test_flash_attn_build_takes_head_paged_metadata(head_case: Any, layer: int) -> None:
    batch = head_case.batches[layer]
    m = _flash_attn_builder().build(0, _head_metadata(batch))
    _check_head_metadata(m, batch, head_case)
    assert m.scheduler_metadata is None


@pytest.mark.parametrize("layer", [0, 2])
def test_triton_build_takes_head_paged_metadata(head_case: Any, layer: int) -> None:
    batch = head_case.batches[layer]
    m = _triton_builder().build(0, _head_metadata(batch))
    _check_head_metadata(m, batch, head_case)


@pytest.mark.parametrize("layer", [0, 2])
def test_flashinfer_pages_are_the_units_tiles(head_case: Any, layer: int,
                                              flashinfer_backend: types.ModuleType) -> None:
    """Each unit's FlashInfer pages are its tile ids, as many as its length needs; the
    last page holds the rest of its length."""
    batch = head_case.batches[layer]
    bs = head_case.space.block_size
    cm = _head_metadata(batch)
    got = _flashinfer_pages(flashinfer_backend, cm.block_table_tensor,
                            cm.seq_lens_cpu_upper_bound, cm.num_reqs, page_size=bs)
    lens = batch.seq_lens.tolist()
    want = [batch.block_table[u, : -(-n // bs)].tolist() for u, n in enumerate(lens)]
    assert got.pages == want
    assert got.indptr == [0, *np.cumsum([len(p) for p in want]).tolist()]
    assert got.last_page_len == [(n - 1) % bs + 1 for n in lens]
