"""vLLM 0.32's GPU MLA metadata builders on our compacted metadata (CPU tensors).

The MLA sibling of ``test_builder_contracts``: the worker compacts evicted blocks out of
``CommonAttentionMetadata`` (``WorkerEvictionState.compact``) before a builder runs, and
these tests pin what the builders of vLLM's CUDA MLA backends do with the result, so a
vLLM upgrade that changes it fails here, without a GPU. The CUDA MLA backends are still
refused at startup (``worker.py``, ``NexusWorker.load_model``); this is the builder half
of lifting that refusal. The sparse MLA builders (DeepSeek V3.2's indexer,
``SparseMLACommonMetadataBuilder``) are not covered.

Every dense CUDA MLA builder runs ``MLACommonMetadataBuilder.build``
(model_executor/layers/attention/mla_attention.py) and overrides at most
``_build_decode``. ``build`` splits the (reordered: decodes first) batch at the
backend's ``reorder_batch_threshold``; decode rows get views of our persistent block
table and ``seq_lens``; prefill rows get a view of the table and their context lengths
from ``seq_lens_cpu_upper_bound - query_len``, which size the chunked-context gather of
the latent cache (``_compute_prefill_context``). The builders are bare objects holding
only the attributes ``build()`` reads (a new read makes them raise), with an MLA-shaped
cache (one latent row of 576 = 512 + 64 per token) and a recording stand-in for the
layer's prefill backend:

- the common builder (what TRITON_MLA, CUTLASS_MLA and TOKENSPEED_MLA run unchanged):
  decode and prefill views, chunked context from the compacted lengths; the context
  gather, run with vLLM's own CPU gather (``ops.gather_mla_context_cache_cpu``) and a
  torch stand-in for the CUDA one's indexing, reads exactly the live rows; with the
  logical upper bound it would read past them (the chunk's own blocks, then null block 0);
- Triton MLA's builder class (``query_len_support`` UNIFORM);
- FlashAttn MLA (fa_utils has no FlashAttention names on CPU: stubbed for one test; its
  FA3 AOT scheduler call recorded), FlashMLA (``get_mla_metadata`` is FlashMLA's, absent
  on CPU: recorded) and FlashInfer MLA (``flashinfer`` absent: stub modules for one test)
  through their own ``_build_decode``;
- CUTLASS MLA's module allocates a CUDA workspace at import (cutlass_mla.py:99 via :72):
  its builder class is read from source and must add nothing to the common one.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import pathlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.integration.conftest import HAS_VLLM
from tests.integration.fakes import BS, FakeRunner, common_metadata, make_state, scheduler_output
from tests.integration.test_builder_contracts import NULL, Batch, _check_compaction_input
from tests.integration.test_builder_contracts import Case as BuilderCase

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

LATENT = 576  # DeepSeek's cached row: kv_lora_rank 512 + qk_rope_head_dim 64
NUM_BLOCKS = 64
MLA_PACKAGE = "vllm.v1.attention.backends.mla"
# Batches as test_builder_contracts' (physical block ids, sequence lengths, query lengths,
# evicted logical blocks per request), decodes first, as vLLM reorders an MLA batch.


@dataclass
class Case(BuilderCase):
    """test_builder_contracts' case plus each row's query tokens (MLA splits decodes)."""

    query: list[int]  # query tokens per row

    @property
    def decodes(self) -> int:
        """Leading rows with one query token (MLA's decode rows at threshold 1)."""
        return next((i for i, q in enumerate(self.query) if q > 1), len(self.query))


def _fixed_batch() -> Batch:
    """Two decodes (a loses blocks, b none), then two prefill chunks: c after five
    blocks of context of which it lost two, d a first chunk (no context)."""
    phys = {"a": [3, 7, 8, 2, 5], "b": [9, 10], "c": [11, 12, 13, 14, 15, 16],
            "d": [17, 18]}
    return (phys, [4 * BS + 5, 2 * BS, 5 * BS + 20, BS + 7], [1, 1, 20, BS + 7],
            {"a": (1, 2), "c": (1, 3)})


def _decode_batch() -> Batch:
    """Decodes only (``build`` takes its all-decode shortcut)."""
    phys = {"a": [3, 7, 8, 2, 5], "b": [9, 10], "c": [11, 12, 13, 14]}
    return phys, [4 * BS + 5, 2 * BS, 4 * BS], [1, 1, 1], {"a": (1, 2), "c": (1,)}


def _random_batch(seed: int) -> Batch:
    """2-4 requests: 1+ decodes then 1+ prefill chunks with context; only whole blocks
    behind the query chunk and after the sink are evicted, as the scheduler does. The
    last prefill always loses a block."""
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(2, 5))
    decodes = int(rng.integers(1, rows))
    ids = iter(rng.permutation(np.arange(1, NUM_BLOCKS)).tolist())  # never the null block
    phys, seq, query, evict = {}, [], [], {}
    for r in range(rows):
        prefill = r >= decodes
        nblk = int(rng.integers(3, 9)) if prefill else int(rng.integers(1, 9))
        n = (nblk - 1) * BS + int(rng.integers(1, BS + 1))
        q = int(rng.integers(2, n - 2 * BS + 1)) if prefill else 1
        req = f"r{r}"
        phys[req] = [next(ids) for _ in range(nblk)]
        seq.append(n)
        query.append(q)
        evictable = list(range(1, (n - q) // BS))
        chosen = [j for j in evictable if rng.random() < 0.5]
        if r == rows - 1 and not chosen:
            chosen = [evictable[-1]]
        if chosen:
            evict[req] = tuple(chosen)
    return phys, seq, query, evict


@pytest.fixture(params=["fixed", "decodes", 0, 1, 2, 3],
                ids=lambda s: s if isinstance(s, str) else f"seed{s}")
def case(request: pytest.FixtureRequest) -> Iterator[Case]:
    """A compacted batch, inside an armed step (as when vLLM calls the builders)."""
    from nexus_vllm.integration.protocol import StepPlan

    p = request.param
    phys, seq, query, evict = (_fixed_batch() if p == "fixed" else _decode_batch()
                               if p == "decodes" else _random_batch(p))
    runner = FakeRunner(phys)
    state = make_state(runner, max_requests=max(4, len(phys)), heads=1, head_size=LATENT)
    step = state.begin_step(scheduler_output(), StepPlan(step_id=1, evict=evict))
    logical = common_metadata(runner, seq, query)
    compacted = state.compactor.compact(logical)
    live = [[b for j, b in enumerate(phys[r]) if j not in evict.get(r, ())] for r in phys]
    live_lens = [n - BS * len(evict.get(r, ())) for r, n in zip(phys, seq)]
    yield Case(state, logical, compacted, live, live_lens, query)
    state.end_step(step)


# -- bare builders ----------------------------------------------------------------------
class _PrefillBackend:
    """Stand-in for the layer's MLA prefill backend (``MLAPrefillBackend``): ``build``
    hands it the prefill metadata; the real ones read ``query_start_loc`` and the chunks
    (prefill/base.py, flashinfer.py, trtllm_ragged.py)."""

    def __init__(self) -> None:
        self.prepared: list[Any] = []

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        self.prepared.append(prefill_metadata)


def _bare(cls: type, metadata_cls: type, *, workspace_rows: int = 64 * BS,
          **attrs: Any) -> Any:
    """An MLA builder of class ``cls`` as ``MLACommonMetadataBuilder.__init__`` leaves it
    without DCP, PCP or spec decode, fp32, one latent row of ``LATENT``: just the
    attributes ``build()`` reads, plus ``attrs`` (the subclass's own)."""
    b = object.__new__(cls)
    b.metadata_cls = metadata_cls
    b.device = torch.device("cpu")
    b.reorder_batch_threshold = cls.reorder_batch_threshold  # _init_reorder_batch_threshold
    b.use_pcp = False
    b.page_size = BS
    b.chunked_prefill_workspace_size = workspace_rows
    b.chunked_prefill_workspace = torch.zeros(workspace_rows, LATENT)
    b.dcp_world_size = 1
    b.dcp_local_block_size = b.dcp_virtual_block_size = 1
    b.dcp_manager = None
    b.model_config = SimpleNamespace(dtype=torch.float32, get_head_size=lambda: LATENT)
    b.q_data_type = torch.float32
    b._prefill_backend = _PrefillBackend()
    for name, value in attrs.items():
        setattr(b, name, value)
    return b


def _common_builder(**kw: Any) -> Any:
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonMetadata,
        MLACommonMetadataBuilder,
    )

    return _bare(MLACommonMetadataBuilder, MLACommonMetadata, **kw)


def _same_storage(view: torch.Tensor, base: torch.Tensor, first_row: int) -> bool:
    """``view`` is ``base[first_row:...]`` in place (no copy)."""
    offset = first_row * base.stride(0) * base.element_size()
    return (view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            and view.data_ptr() == base.data_ptr() + offset)


def _check_decode(m: Any, c: Case, decodes: int) -> None:
    """Decode rows ``[0, decodes)`` read our persistent table and lengths in place."""
    assert m.num_decodes == decodes
    assert m.num_decode_tokens == sum(c.query[:decodes])
    d = m.decode
    if decodes == 0:
        assert d is None
        return
    assert _same_storage(d.block_table, c.compacted.block_table_tensor, 0)
    assert _same_storage(d.seq_lens, c.compacted.seq_lens, 0)
    # The same storage as the state's persistent buffers (what a FULL graph would replay).
    assert d.block_table.data_ptr() == c.state.compactor._tables.data_ptr()
    assert d.seq_lens.data_ptr() == c.state.compactor._lens.data_ptr()
    assert d.block_table.shape[0] == d.seq_lens.shape[0] == decodes
    assert d.seq_lens.tolist() == c.live_lens[:decodes]
    for row, ids in enumerate(c.live[:decodes]):
        assert d.block_table[row, : len(ids)].tolist() == ids


def _check_common(m: Any, c: Case, decodes: int) -> None:
    """What ``MLACommonMetadataBuilder.build`` gives every MLA backend."""
    _check_compaction_input(c)
    assert m.max_seq_len == c.compacted.max_seq_len == max(c.live_lens)
    assert m.query_start_loc is c.compacted.query_start_loc
    # Writes go to physical slots: compaction leaves slot_mapping alone.
    assert m.slot_mapping is c.compacted.slot_mapping
    assert m.num_reqs == len(c.live)
    assert m.num_prefills == len(c.live) - decodes
    _check_decode(m, c, decodes)


# -- the common builder -----------------------------------------------------------------
def test_common_build_keeps_compacted_buffers(case: Case) -> None:
    """``build`` splits decodes from prefills by query length and hands both our table
    and lengths by reference (views, no copy); prefill context lengths come from the
    compacted upper bound, and the prefill backend is prepared with them."""
    c = case
    b = _common_builder()
    m = b.build(0, c.compacted)
    _check_common(m, c, c.decodes)
    p = m.prefill
    if c.decodes == len(c.live):
        assert p is None and b._prefill_backend.prepared == []
        return
    assert b._prefill_backend.prepared == [p]
    assert _same_storage(p.block_table, c.compacted.block_table_tensor, c.decodes)
    for row, ids in enumerate(c.live[c.decodes:]):
        assert p.block_table[row, : len(ids)].tolist() == ids
    ctx = [n - q for n, q in zip(c.live_lens, c.query)][c.decodes:]
    assert p.query_lens_cpu.tolist() == c.query[c.decodes:]
    if max(ctx) == 0:
        assert p.chunked_context is None
        return
    assert p.chunked_context.context_lens_list == ctx
    assert p.chunked_context.context_lens.tolist() == ctx


def _gathered(m: Any) -> dict[int, list[tuple[int, int]]]:
    """The (position, block id) of every context row the gather reads, per prefill row
    of the batch: the indexing of the CUDA ``gather_and_maybe_dequant_cache`` arguments
    (mla_attention.py ``_compute_prefill_context``): workspace token ``i`` belongs to
    request ``token_to_seq[i]`` of the chunk, at context position ``starts[s] + i -
    cu_seq_lens[s]``, in block ``block_table[s, pos // page]``."""
    p = m.prefill
    out: dict[int, list[tuple[int, int]]] = {}
    for chunk in p.chunked_context.chunks:
        table = p.block_table[chunk.request_slice]
        cu, starts = chunk.cu_seq_lens.tolist(), chunk.starts.tolist()
        for i, s in enumerate(chunk.token_to_seq.tolist()):
            pos = starts[s] + i - cu[s]
            row = m.num_decodes + chunk.request_slice.start + s
            out.setdefault(row, []).append((pos, int(table[s, pos // BS])))
    return out


def _latent_cache() -> torch.Tensor:
    """An MLA layer's cache ``[num_blocks, block_size, latent]`` whose rows are unique."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(NUM_BLOCKS, BS, LATENT, generator=g)


@pytest.mark.parametrize("workspace_blocks", [2, 64], ids=["split", "whole"])
def test_context_gather_reads_the_live_rows(case: Case, workspace_blocks: int) -> None:
    """From the compacted metadata, the chunked-context gather of each prefill reads its
    live context rows in order, never the null block (CUDA indexing and vLLM's CPU
    gather agree); a small workspace splits contexts across chunks (``starts`` > 0)."""
    from vllm import _custom_ops as ops

    c = case
    b = _common_builder(workspace_rows=workspace_blocks * BS)
    m = b.build(0, c.compacted)
    ctx = [n - q for n, q in zip(c.live_lens, c.query)]
    if m.prefill is None or m.prefill.chunked_context is None:
        assert all(x == 0 for x in ctx[c.decodes:])
        return
    got = _gathered(m)
    for row in range(c.decodes, len(c.live)):
        want = [(t, c.live[row][t // BS]) for t in range(ctx[row])]
        assert got.get(row, []) == want
        assert all(blk != NULL for _, blk in want)
    cache = _latent_cache()
    flat = cache.view(-1, LATENT)
    for chunk in m.prefill.chunked_context.chunks:
        toks = chunk.num_context_tokens
        ws = m.prefill.chunked_context.workspace
        ws.zero_()
        ops.gather_mla_context_cache_cpu(
            src_cache=cache, dst=ws[:toks],
            block_table=m.prefill.block_table[chunk.request_slice], starts=chunk.starts,
            cu_seq_lens=chunk.cu_seq_lens)
        cu, starts = chunk.cu_seq_lens.tolist(), chunk.starts.tolist()
        for s in range(chunk.num_requests):
            row = c.decodes + chunk.request_slice.start + s
            pos = range(starts[s], starts[s] + cu[s + 1] - cu[s])
            slots = [c.live[row][t // BS] * BS + t % BS for t in pos]
            assert torch.equal(ws[cu[s]: cu[s + 1]], flat[slots])
    if workspace_blocks == 2 and max(ctx) > 2 * BS:
        assert any(chunk.is_continuation for chunk in m.prefill.chunked_context.chunks)


def test_logical_upper_bound_pulls_in_null_block(case: Case) -> None:
    """Why compaction must rewrite the CPU upper bound for MLA: the compacted table with
    the logical ``seq_lens_cpu_upper_bound`` sizes each evicting prefill's context
    gather by its logical length, so it reads past its live context: the blocks after
    it (the chunk's own), then the null block 0 (prompt attention would see them)."""
    c = case
    stale = replace(c.compacted, seq_lens_cpu_upper_bound=c.logical.seq_lens_cpu_upper_bound)
    m = _common_builder().build(0, stale)
    if c.decodes == len(c.live):
        assert m.prefill is None  # decodes only: the upper bound is not read
        return
    got = _gathered(m)
    logical = c.logical.seq_lens_cpu_upper_bound.tolist()
    over = 0
    for row in range(c.decodes, len(c.live)):
        ctx, live_ctx = logical[row] - c.query[row], c.live_lens[row] - c.query[row]
        reads = got.get(row, [])
        assert [pos for pos, _ in reads] == list(range(ctx))
        nblk = -(-ctx // BS)
        blocks = [blk for pos, blk in reads if pos % BS == 0]
        assert blocks == (c.live[row] + [NULL] * nblk)[:nblk]
        assert (NULL in blocks) == (nblk > len(c.live[row]))
        over += ctx > live_ctx
    assert over > 0


# -- Triton MLA -------------------------------------------------------------------------
def test_triton_mla_build_keeps_compacted_buffers(case: Case) -> None:
    """TRITON_MLA runs the common ``build`` (UNIFORM query lengths, threshold 1); its
    ``forward_mqa`` reads ``decode.block_table``, ``decode.seq_lens`` and, for its KV
    splits, ``max_seq_len``: ours, by reference, and the compacted maximum."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAMetadataBuilder

    assert "build" not in vars(TritonMLAMetadataBuilder)
    assert "_build_decode" not in vars(TritonMLAMetadataBuilder)
    m = _bare(TritonMLAMetadataBuilder, MLACommonMetadata).build(0, case.compacted)
    _check_common(m, case, case.decodes)


# -- FlashAttn MLA ----------------------------------------------------------------------
@pytest.fixture
def flashattn_mla(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """vLLM's ``flashattn_mla`` module, imported over stub FlashAttention names (on CPU
    fa_utils defines ``flash_attn_varlen_func`` and ``get_scheduler_metadata`` only for
    CUDA, XPU and ROCm); the module leaves ``sys.modules`` after the test."""
    from vllm.v1.attention.backends import fa_utils

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("stub FlashAttention called: this test runs no kernel")

    for name in ("flash_attn_varlen_func", "get_scheduler_metadata"):
        monkeypatch.setattr(fa_utils, name, unavailable, raising=False)
    yield from _fresh_import(monkeypatch, f"{MLA_PACKAGE}.flashattn_mla")


def _fresh_import(monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[types.ModuleType]:
    """Import ``name`` anew; afterwards drop it from ``sys.modules`` and its package."""
    monkeypatch.delitem(sys.modules, name, raising=False)
    package = importlib.import_module(name.rsplit(".", 1)[0])
    short = name.rsplit(".", 1)[1]
    had_attr = hasattr(package, short)
    try:
        yield importlib.import_module(name)
    finally:
        sys.modules.pop(name, None)
        if not had_attr and hasattr(package, short):
            delattr(package, short)


def test_flashattn_mla_build_keeps_compacted_buffers(
        case: Case, flashattn_mla: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASH_ATTN_MLA decodes every row of up to 512 query tokens (VARLEN): prefill
    chunks too read our table and lengths in place, with the compacted ``max_seq_len``;
    FA3's AOT scheduler (Hopper) is given the same lengths and maximum."""
    mod = flashattn_mla
    calls: list[dict[str, Any]] = []

    def scheduler(**kw: Any) -> torch.Tensor:
        calls.append(kw)
        return torch.zeros(4, dtype=torch.int32)

    monkeypatch.setattr(mod, "get_scheduler_metadata", scheduler)
    cls = mod.FlashAttnMLAMetadataBuilder
    assert "build" not in vars(cls)
    b = _bare(cls, mod.FlashAttnMLAMetadata, fa_aot_schedule=True, use_full_cuda_graph=False,
              max_cudagraph_size=None, max_num_splits=0, num_heads=4,
              mla_dims=SimpleNamespace(qk_rope_head_dim=64, kv_lora_rank=512),
              kv_cache_spec=SimpleNamespace(dtype=torch.float32))
    c = case
    assert max(c.query) <= cls.reorder_batch_threshold
    m = b.build(0, c.compacted)
    _check_common(m, c, len(c.live))
    d = m.decode
    assert d.max_seq_len == max(c.live_lens)
    assert d.max_query_len == max(c.query)
    assert _same_storage(d.query_start_loc, c.compacted.query_start_loc, 0)
    [kw] = calls
    assert kw["cache_seqlens"] is d.seq_lens
    assert kw["max_seqlen_k"] == max(c.live_lens)
    assert kw["page_size"] == BS and kw["headdim"] == 64 and kw["headdim_v"] == 512
    assert d.scheduler_metadata is not None


# -- FlashMLA ---------------------------------------------------------------------------
def test_flashmla_build_keeps_compacted_buffers(case: Case,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASHMLA decodes uniform rows of up to 128 query tokens; its ``_build_decode``
    gives FlashMLA's ``get_mla_metadata`` (absent on CPU: recorded here) our lengths in
    place and keeps our table."""
    from vllm.v1.attention.backends.mla import flashmla

    calls: list[tuple[Any, ...]] = []

    def get_mla_metadata(*args: Any, **kwargs: Any) -> tuple[Any, None]:
        calls.append(args)
        return flashmla.FlashMLASchedMeta(), None

    monkeypatch.setattr(flashmla, "get_mla_metadata", get_mla_metadata)
    cls = flashmla.FlashMLAMetadataBuilder
    assert "build" not in vars(cls)
    b = _bare(cls, flashmla.FlashMLAMetadata, num_q_heads=4, is_fp8_kvcache=False)
    c = case
    m = b.build(0, c.compacted)
    # UNIFORM: the leading one-token rows decode, the first longer one starts prefill.
    _check_common(m, c, c.decodes)
    if c.decodes:
        [args] = calls
        assert args[0] is m.decode.seq_lens
        assert isinstance(m.decode.scheduler_metadata, flashmla.FlashMLASchedMeta)
    else:
        assert calls == []


# -- FlashInfer MLA ---------------------------------------------------------------------
_FLASHINFER_NAMES = {
    "flashinfer": (),
    "flashinfer.decode": ("trtllm_batch_decode_with_kv_cache_mla",),
    "flashinfer.utils": ("get_device_sm_count", "get_trtllm_gen_multi_ctas_kv_counter_bytes"),
}


@pytest.fixture
def flashinfer_mla(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """vLLM's ``flashinfer_mla`` module over stub ``flashinfer*`` modules (what it
    imports, vLLM 0.32); stubs and module leave ``sys.modules`` after the test."""
    from vllm.utils import flashinfer as fi_utils

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("stub FlashInfer called: this test runs no kernel")

    for name, attrs in _FLASHINFER_NAMES.items():
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None,
                                                      is_package=name == "flashinfer")
        for attr in attrs:
            setattr(mod, attr, unavailable)
        monkeypatch.setitem(sys.modules, name, mod)
    for name in _FLASHINFER_NAMES:
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(sys.modules[parent], child, sys.modules[name])
    try:
        yield from _fresh_import(monkeypatch, f"{MLA_PACKAGE}.flashinfer_mla")
    finally:
        # A probe run while the stubs were in place must not stay cached.
        for probe in ("has_flashinfer", "has_flashinfer_cubin"):
            clear = getattr(getattr(fi_utils, probe, None), "cache_clear", None)
            if clear is not None:
                clear()


def test_flashinfer_mla_build_keeps_compacted_buffers(
        case: Case, flashinfer_mla: types.ModuleType) -> None:
    """FLASHINFER_MLA (VARLEN, threshold 1 without spec decode) passes our table,
    lengths and query offsets through; its TRT-LLM decode reads them and the compacted
    ``max_seq_len``."""
    mod = flashinfer_mla
    cls = mod.FlashInferMLAMetadataBuilder
    assert "build" not in vars(cls)
    c = case
    m = _bare(cls, mod.FlashInferMLAMetadata).build(0, c.compacted)
    _check_common(m, c, c.decodes)
    if c.decodes:
        d = m.decode
        assert _same_storage(d.query_start_loc, c.compacted.query_start_loc, 0)
        assert d.max_query_len == 1
        assert d.flattened_block_table is None  # built lazily, from d.block_table


# -- builders that add nothing ----------------------------------------------------------
def _class_methods(path: str, name: str) -> tuple[list[str], list[str]]:
    """Base class names and method names of class ``name`` in the source file ``path``."""
    tree = ast.parse(pathlib.Path(path).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            bases = [ast.unparse(b) for b in node.bases]
            return bases, [n.name for n in node.body if isinstance(n, ast.FunctionDef)]
    raise AssertionError(f"class {name} not found in {path}")


def test_cutlass_and_tokenspeed_builders_are_the_common_one() -> None:
    """CUTLASS_MLA's builder adds no method to ``MLACommonMetadataBuilder`` (read from
    source: importing cutlass_mla.py allocates a CUDA workspace), TOKENSPEED_MLA's only
    ``__init__``: both run the common ``build`` pinned above."""
    spec = importlib.util.find_spec(f"{MLA_PACKAGE}.cutlass_mla")
    assert spec is not None and spec.origin is not None
    bases, methods = _class_methods(spec.origin, "CutlassMLAMetadataBuilder")
    assert bases == ["MLACommonMetadataBuilder[MLACommonMetadata]"]
    assert methods == []
    from vllm.v1.attention.backends.mla.tokenspeed_mla import TokenspeedMLAMetadataBuilder

    own = {k for k, v in vars(TokenspeedMLAMetadataBuilder).items() if callable(v)}
    assert own == {"__init__"}
