"""Block-table compaction: Triton kernel (interpreter / GPU) and torch path vs a loop oracle."""

from __future__ import annotations

import pytest
import torch

from nexus_vllm.kernels import ops
from nexus_vllm.kernels.ops import compact_block_tables

triton_only = pytest.mark.skipif(not ops.HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BACKENDS = ["torch", pytest.param("triton", marks=triton_only)]
# (table dtype, block size): both index dtypes, and block sizes up to a wide 128.
DTYPE_BLOCK_SIZES = [
    pytest.param(torch.int32, 16, id="int32-bs16"),
    pytest.param(torch.int64, 32, id="int64-bs32"),
    pytest.param(torch.int32, 128, id="int32-bs128"),
]
# (requests, max_blocks): one row, a typical batch, tables wider than one kernel tile.
TABLE_SHAPES = [(1, 5), (7, 33), (3, 1500)]
NULL_FRACTIONS = [0.0, 0.4, 1.0]
SEED = 99


def _oracle(block_tables, seq_lens, block_size, null_block):
    """Plain Python loop: the definition of compaction."""
    r, m = block_tables.shape
    tables = torch.full_like(block_tables, null_block)
    lens = seq_lens.clone()
    for i in range(r):
        s = int(seq_lens[i])
        n = -(-s // block_size)
        kept = [int(b) for b in block_tables[i, :n] if int(b) != null_block]
        tables[i, : len(kept)] = torch.tensor(kept, dtype=block_tables.dtype)
        dropped = sum(
            min(block_size, s - j * block_size)
            for j in range(n)
            if int(block_tables[i, j]) == null_block
        )
        lens[i] = s - dropped
    return tables, lens


def _random_tables(r, m, block_size, null_frac, dtype, null_block=0, gen_seed=SEED):
    gen = torch.Generator().manual_seed(gen_seed)
    seq = torch.randint(0, m * block_size + 1, (r,), generator=gen)
    seq[0] = m * block_size  # one full row
    if r > 1:
        seq[1] = 0  # one empty row
    ids = torch.randint(1, 10_000, (r, m), generator=gen)
    ids[ids == null_block] = null_block + 1
    nulls = torch.rand(r, m, generator=gen) < null_frac
    tables = torch.where(nulls, torch.full_like(ids, null_block), ids)
    return tables.to(dtype), seq.to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dtype", "block_size"), DTYPE_BLOCK_SIZES)
@pytest.mark.parametrize("null_frac", NULL_FRACTIONS)
@pytest.mark.parametrize("shape", TABLE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_compaction_matches_oracle(shape, null_frac, dtype, block_size, backend):
    r, m = shape
    bt, sl = _random_tables(r, m, block_size, null_frac, dtype)
    want_t, want_s = _oracle(bt, sl, block_size, 0)
    got_t, got_s = compact_block_tables(bt, sl, block_size, backend=backend)
    assert got_t.dtype == dtype and got_s.dtype == dtype
    torch.testing.assert_close(got_t, want_t, rtol=0, atol=0)
    torch.testing.assert_close(got_s, want_s, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compaction_worked_example_and_persistent_buffers(backend):
    bt = torch.tensor(
        [[5, 0, 7, 0, 9, 3], [0, 0, 4, 0, 0, 0], [8, 8, 8, 0, 0, 0]], dtype=torch.int32
    )
    # Row 0: 5 logical blocks (entry 3 is past them); row 1: partial block 2 (8 tokens);
    # row 2: nothing evicted.
    sl = torch.tensor([80, 40, 48], dtype=torch.int32)
    out_t = torch.full_like(bt, -7)
    out_s = torch.full_like(sl, -7)
    ptr_t, ptr_s = out_t.data_ptr(), out_s.data_ptr()
    ret_t, ret_s = compact_block_tables(
        bt, sl, 16, out_tables=out_t, out_seq_lens=out_s, backend=backend
    )
    assert ret_t is out_t and ret_s is out_s
    assert out_t.data_ptr() == ptr_t and out_s.data_ptr() == ptr_s
    assert out_t.tolist() == [[5, 7, 9, 0, 0, 0], [4, 0, 0, 0, 0, 0], [8, 8, 8, 0, 0, 0]]
    assert out_s.tolist() == [48, 8, 48]


@pytest.mark.parametrize("backend", BACKENDS)
def test_compaction_custom_null_and_strided_views(backend):
    """A non-zero null id, and rows/outputs that are slices of larger persistent buffers."""
    big = torch.full((6, 10), 3, dtype=torch.int64)
    big[:4, :8] = torch.tensor([[3, 11, 12, 3, 13, 3, 3, 3]] * 4)
    view = big[:4, :8]
    sl = torch.tensor([[70, 1], [64, 1], [33, 1], [0, 1]], dtype=torch.int64)[:, 0]
    out_big = torch.zeros(6, 10, dtype=torch.int64)
    out_s_big = torch.zeros(6, 2, dtype=torch.int64)
    assert not sl.is_contiguous() and not out_s_big[:4, 1].is_contiguous()
    compact_block_tables(
        view, sl, 16, null_block=3, out_tables=out_big[:4, :8], out_seq_lens=out_s_big[:4, 1],
        backend=backend,
    )  # fmt: skip
    want_t, want_s = _oracle(view, sl, 16, 3)
    assert torch.equal(out_big[:4, :8], want_t)
    assert torch.equal(out_s_big[:4, 1], want_s)
    assert torch.all(out_s_big[:, 0] == 0) and torch.all(out_s_big[4:] == 0)
    assert torch.all(out_big[4:] == 0) and torch.all(out_big[:, 8:] == 0)


def test_compaction_errors():
    bt = torch.ones(2, 4, dtype=torch.int32)
    sl = torch.tensor([10, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size"):
        compact_block_tables(bt, sl, 0)
    with pytest.raises(ValueError, match="out_tables"):
        compact_block_tables(bt, sl, 16, out_tables=torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="out_seq_lens"):
        compact_block_tables(bt, sl, 16, out_seq_lens=torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="seq_lens"):
        compact_block_tables(bt, sl.float(), 16)
    with pytest.raises(ValueError, match="block_tables"):
        compact_block_tables(bt.float(), sl, 16)
    with pytest.raises(ValueError, match="overlap"):
        compact_block_tables(bt, sl, 16, out_tables=bt, backend="torch")
    with pytest.raises(ValueError, match="seq_lens"):
        compact_block_tables(bt, torch.tensor([10, 65], dtype=torch.int32), 16, backend="torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_compaction_under_torch_compile(backend):
    bt, sl = _random_tables(5, 20, 16, 0.3, torch.int32)
    out_t = torch.empty_like(bt)
    out_s = torch.empty_like(sl)

    def step(bt, sl, out_t, out_s):
        compact_block_tables(bt, sl, 16, out_tables=out_t, out_seq_lens=out_s, backend=backend)
        return out_s.sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    total = compiled(bt, sl, out_t, out_s)
    want_t, want_s = _oracle(bt, sl, 16, 0)
    assert torch.equal(out_t, want_t) and torch.equal(out_s, want_s)
    assert int(total) == int(want_s.sum())


def test_compaction_opcheck():
    bt, sl = _random_tables(4, 9, 16, 0.3, torch.int32)
    torch.library.opcheck(
        torch.ops.nexus_vllm.compact_block_tables.default,
        (bt, sl, torch.empty_like(bt), torch.empty_like(sl), 16, 0, "torch", True),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.gpu
@needs_cuda
@triton_only
def test_compaction_gpu_and_cuda_graph():
    bt, sl = _random_tables(64, 512, 16, 0.3, torch.int32)
    want_t, want_s = _oracle(bt, sl, 16, 0)
    bt_d, sl_d = bt.cuda(), sl.cuda()
    out_t = torch.empty_like(bt_d)
    out_s = torch.empty_like(sl_d)
    compact_block_tables(bt_d, sl_d, 16, out_tables=out_t, out_seq_lens=out_s)  # warm-up/compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compact_block_tables(bt_d, sl_d, 16, out_tables=out_t, out_seq_lens=out_s)
    out_t.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_t.cpu(), want_t) and torch.equal(out_s.cpu(), want_s)
