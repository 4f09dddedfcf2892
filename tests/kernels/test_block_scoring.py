"""Paged block scoring: Triton kernel (CPU interpreter here, GPU under ``-m gpu``) vs core."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nexus_vllm.core import scoring
from nexus_vllm.core.scoring import (
    ATTENTION_REDUCES,
    KV_LAYOUTS,
    block_attention_mass,
    gather_paged_keys,
    num_blocks_for,
)
from nexus_vllm.kernels import _launch, _reference, ops
from nexus_vllm.kernels.ops import block_attention_mass_paged, block_attention_mass_paged_layers

triton_only = pytest.mark.skipif(not ops.HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZES = [16, 32, 64]
# (R, W, Hq, Hkv, D): GQA groups 1/2/3/4, non-power-of-two D and W, W = 1.
HEAD_SHAPES = [
    (2, 4, 4, 2, 32),
    (1, 1, 1, 1, 16),
    (2, 3, 6, 2, 40),
    (1, 16, 8, 2, 64),
]
# Live lengths per request: empty, shorter than W, exactly a block, partial last block.
SEQ_LEN_SETS = [[0, 2, 16, 77], [1, 33, 64, 150]]
# (seq_lens, attention_reduce) for the cheap reference tests: both reductions on the set with
# an empty request, only the mean on the others (the interpreter's CI time is the budget).
SEQ_REDUCES = [(SEQ_LEN_SETS[0], hr) for hr in ATTENTION_REDUCES] + [
    (s, "mean") for s in SEQ_LEN_SETS[1:]
]
# Absolute floor added to the 2x error-ratio bound, per input dtype.
ATOL_FLOOR = {torch.float32: 1e-6, torch.float16: 1e-5, torch.bfloat16: 1e-5}
SEED = 1234


def _make_case(
    seq_lens: list[int],
    w: int,
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    kv_layout: str,
    *,
    device: str = "cpu",
    spare_blocks: int = 2,
    q_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random queries, an overflow-sized paged cache, shuffled block tables, seq lens."""
    gen = torch.Generator().manual_seed(SEED)
    r = len(seq_lens)
    max_blocks = max(num_blocks_for(s, block_size) for s in seq_lens) + spare_blocks
    num_blocks = r * max_blocks + 3  # block 0 plus spares never referenced
    shape = (
        (num_blocks, block_size, hkv, d) if kv_layout == "NHD" else (num_blocks, hkv, block_size, d)
    )
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    queries = (torch.randn(r, w, hq, d, generator=gen) * q_scale).to(dtype)
    ids = torch.randperm(num_blocks - 1, generator=gen)[: r * max_blocks] + 1
    block_tables = ids.view(r, max_blocks).to(torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return queries.to(device), key_cache.to(device), block_tables.to(device), seq.to(device)


def _mass_in_dtype(queries: torch.Tensor, keys: torch.Tensor, block_size: int, dtype: torch.dtype,
                   attention_reduce: str = "mean"):
    """``block_attention_mass`` math run entirely in ``dtype`` (the error yardstick)."""
    w, hq, d = queries.shape
    t, hkv, _ = keys.shape
    q = queries.to(dtype).permute(1, 0, 2)
    k = keys.to(dtype).repeat_interleave(hq // hkv, dim=1).permute(1, 2, 0)
    logits = torch.matmul(q, k) * (1.0 / math.sqrt(d))
    pos = torch.arange(t, device=logits.device)
    future = pos[None, :] > pos[t - w :, None]
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    n = num_blocks_for(t, block_size)
    padded = torch.nn.functional.pad(probs, (0, n * block_size - t))
    per_head = padded.view(hq, w, n, block_size).sum(dim=-1)
    return per_head.mean(dim=0) if attention_reduce == "mean" else per_head.amax(dim=0)


def _references(queries, key_cache, block_tables, seq_lens, kv_layout, attention_reduce="mean"):
    """Per request: fp64 truth, same math in the input dtype, and core (fp32)."""
    r, w = queries.shape[:2]
    m = block_tables.shape[1]
    block_size = key_cache.shape[1] if kv_layout == "NHD" else key_cache.shape[2]
    exact = torch.zeros(r, w, m, dtype=torch.float64)
    lowp = torch.zeros(r, w, m, dtype=torch.float64)
    core = torch.zeros(r, w, m, dtype=torch.float32)
    for i, s in enumerate(seq_lens.tolist()):
        wl = min(w, s)
        if wl == 0:
            continue
        n = num_blocks_for(s, block_size)
        # References run where the inputs live (GPU cases: fast fp64 and native low precision).
        keys = gather_paged_keys(key_cache, block_tables[i], s, kv_layout=kv_layout)
        q = queries[i, w - wl :]
        exact[i, w - wl :, :n] = _mass_in_dtype(q, keys, block_size, torch.float64,
                                                attention_reduce).cpu()
        lowp[i, w - wl :, :n] = _mass_in_dtype(q, keys, block_size, queries.dtype,
                                               attention_reduce).double().cpu()
        core[i, w - wl :, :n] = block_attention_mass(q, keys, block_size,
                                                     attention_reduce=attention_reduce).cpu()
    return exact, lowp, core


def _assert_within_bound(got: torch.Tensor, exact: torch.Tensor, lowp: torch.Tensor, dtype) -> None:
    err = (got.cpu().double() - exact).abs().max().item()
    bound = 2.0 * (lowp - exact).abs().max().item() + ATOL_FLOOR[dtype]
    assert err <= bound, f"kernel error {err:.3e} > bound {bound:.3e}"


def test_reference_helper_matches_core():
    q, kc, bt, sl = _make_case([50], 4, 4, 2, 32, 16, torch.float32, "NHD")
    keys = gather_paged_keys(kc, bt[0], 50)
    torch.testing.assert_close(
        _mass_in_dtype(q[0], keys, 16, torch.float64).float(),
        block_attention_mass(q[0], keys, 16),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize(("seq_lens", "attention_reduce"), SEQ_REDUCES)
def test_torch_backend_equals_core(seq_lens, attention_reduce, kv_layout):
    q, kc, bt, sl = _make_case(seq_lens, 4, 4, 2, 32, 16, torch.float32, kv_layout)
    got = block_attention_mass_paged(q, kc, bt, sl, kv_layout=kv_layout, backend="torch",
                                     attention_reduce=attention_reduce)
    _, _, core = _references(q, kc, bt, sl, kv_layout, attention_reduce)
    assert got.shape == (len(seq_lens), 4, bt.shape[1]) and got.dtype == torch.float32
    torch.testing.assert_close(got, core, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize(("seq_lens", "attention_reduce"), SEQ_REDUCES)
def test_batched_backend_within_bound(seq_lens, attention_reduce, kv_layout, dtype):
    """The vectorised torch path (the plugin's CPU scorer) against fp64, with the same
    2x-the-input-dtype-error bound as the Triton kernel, and garbage past each row's
    blocks (it gathers whole rows)."""
    q, kc, bt, sl = _make_case(seq_lens, 4, 4, 2, 32, 16, dtype, kv_layout)
    bt = bt.clone()
    for i, s in enumerate(sl.tolist()):
        bt[i, num_blocks_for(s, 16) :] = kc.shape[0] + 7  # out of range: must not matter
    got = block_attention_mass_paged(q, kc, bt, sl, kv_layout=kv_layout, backend="batched",
                                     attention_reduce=attention_reduce)
    exact, lowp, core = _references(q, kc, bt, sl, kv_layout, attention_reduce)
    _assert_within_bound(got, exact, lowp, dtype)
    torch.testing.assert_close(got, core, rtol=0, atol=2e-6)


@triton_only
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference(dtype, block_size, kv_layout):
    seq_lens = [0, 3, block_size, 2 * block_size + 5]
    q, kc, bt, sl = _make_case(seq_lens, 4, 4, 2, 32, block_size, dtype, kv_layout)
    got = block_attention_mass_paged(q, kc, bt, sl, kv_layout=kv_layout, backend="triton")
    exact, lowp, core = _references(q, kc, bt, sl, kv_layout)
    _assert_within_bound(got, exact, lowp, dtype)
    # Structure: zero rows for positions < 0, zero columns past the block count, sums 1.
    for i, s in enumerate(seq_lens):
        n = num_blocks_for(s, block_size)
        assert torch.all(got[i, :, n:] == 0)
        assert torch.all(got[i, : max(0, 4 - s)] == 0)
        torch.testing.assert_close(
            got[i, max(0, 4 - s) :].sum(-1), torch.ones(min(4, s)), rtol=0, atol=1e-5
        )


@triton_only
@pytest.mark.parametrize(
    ("dtype", "kv_layout", "w", "hq", "hkv"),
    [(torch.float32, "NHD", 4, 4, 4), (torch.bfloat16, "HND", 3, 6, 2)],
)
def test_triton_max_over_heads_matches_reference(dtype, kv_layout, w, hq, hkv):
    """The combine launch's maximum over the query heads (GQA groups of 1 and 3), with an
    empty request and rows shorter than the window, within the error bound (the random
    configs below cover the other dtypes and block sizes)."""
    seq_lens = [0, 2, 16, 41]
    q, kc, bt, sl = _make_case(seq_lens, w, hq, hkv, 32, 16, dtype, kv_layout)
    got = block_attention_mass_paged(q, kc, bt, sl, kv_layout=kv_layout, backend="triton",
                                     attention_reduce="max")
    exact, lowp, _ = _references(q, kc, bt, sl, kv_layout, "max")
    _assert_within_bound(got, exact, lowp, dtype)
    # Structure: padding rows and columns past the blocks are 0; a row of maxima over
    # heads sums to at least 1 (the mean's sum), not to 1.
    for i, s in enumerate(seq_lens):
        n = num_blocks_for(s, 16)
        assert torch.all(got[i, :, n:] == 0) and torch.all(got[i, : max(0, w - s)] == 0)
        assert bool((got[i, max(0, w - s) :].sum(-1) >= 1 - 1e-5).all())


@pytest.mark.parametrize("backend", ["torch", "batched",
                                     pytest.param("triton", marks=triton_only)])
def test_max_over_heads_combines_by_max_into_out_and_over_layers(backend):
    """With ``out`` and over layers, ``max`` takes the elementwise maximum (a sum would
    grow with the layers), leaving padding rows and columns past the blocks of a non-zero
    ``out`` as they were; it is at least the mean, and equal to it with one head."""
    q, kc, bt, sl = _make_case([3, 50], 4, 4, 2, 32, 16, torch.float32, "NHD")
    one = block_attention_mass_paged(q, kc, bt, sl, backend=backend, attention_reduce="max")
    mean = block_attention_mass_paged(q, kc, bt, sl, backend=backend)
    assert bool((one >= mean - 1e-6).all()) and bool((one > mean + 1e-4).any())
    # A random non-zero out, so that each side of the maximum wins somewhere.
    start = 0.5 * torch.rand(one.shape, generator=torch.Generator().manual_seed(SEED))
    assert bool((one > start).any()) and bool((one < start).any())
    out = start.clone()
    ret = block_attention_mass_paged(q, kc, bt, sl, backend=backend, out=out, attention_reduce="max")
    assert ret is out
    torch.testing.assert_close(out, torch.maximum(start, one), rtol=1e-6, atol=1e-6)
    q2, kc2, _, _ = _make_case([3, 50], 4, 4, 2, 32, 16, torch.float32, "NHD", q_scale=3.0)
    other = block_attention_mass_paged(q2, kc2, bt, sl, backend=backend, attention_reduce="max")
    layers = block_attention_mass_paged_layers(torch.stack([q, q2]), [kc, kc2], bt, sl,
                                               backend=backend, attention_reduce="max")
    torch.testing.assert_close(layers, torch.maximum(one, other), rtol=1e-6, atol=1e-6)
    out = start.clone()
    block_attention_mass_paged_layers(torch.stack([q, q2]), [kc, kc2], bt, sl,
                                      backend=backend, out=out, attention_reduce="max")
    torch.testing.assert_close(out, torch.maximum(start, layers), rtol=1e-6, atol=1e-6)
    q1, kc1, bt1, sl1 = _make_case([30, 50], 4, 1, 1, 32, 16, torch.float32, "NHD")
    torch.testing.assert_close(
        block_attention_mass_paged(q1, kc1, bt1, sl1, backend=backend, attention_reduce="max"),
        block_attention_mass_paged(q1, kc1, bt1, sl1, backend=backend), rtol=1e-6, atol=1e-6)


@triton_only
@pytest.mark.parametrize("shape", HEAD_SHAPES)
@pytest.mark.parametrize("seq_lens", SEQ_LEN_SETS)
def test_triton_head_shapes(shape, seq_lens):
    r, w, hq, hkv, d = shape
    seq_lens = seq_lens[:r] if r < len(seq_lens) else seq_lens
    q, kc, bt, sl = _make_case(seq_lens, w, hq, hkv, d, 16, torch.float32, "NHD")
    got = block_attention_mass_paged(q, kc, bt, sl, backend="auto")  # interpreter => triton
    exact, lowp, _ = _references(q, kc, bt, sl, "NHD")
    _assert_within_bound(got, exact, lowp, torch.float32)


def _random_configs(n: int) -> list[tuple]:
    """Seeded random (dtype, block size, layout, W, Hkv, group, D, seq_lens) draws."""
    gen = torch.Generator().manual_seed(SEED + 1)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    configs = []
    for _ in range(n):
        bs = pick(BLOCK_SIZES)
        r = pick([1, 2, 3])
        seq = torch.randint(0, 5 * bs, (r,), generator=gen).tolist()
        configs.append(
            (pick(DTYPES), bs, pick(KV_LAYOUTS), pick([1, 2, 5, 8]), pick([1, 2]),
             pick([1, 2, 4]), pick([16, 24, 64]), seq)
        )  # fmt: skip
    return configs


@triton_only
@pytest.mark.parametrize(
    ("config", "attention_reduce"),
    # Alternating reductions: the draws stay those of the mean-only test (at no extra cost).
    [(c, ATTENTION_REDUCES[i % len(ATTENTION_REDUCES)]) for i, c in enumerate(_random_configs(8))],
)
def test_triton_random_configs(config, attention_reduce):
    dtype, bs, layout, w, hkv, group, d, seq_lens = config
    q, kc, bt, sl = _make_case(seq_lens, w, hkv * group, hkv, d, bs, dtype, layout)
    got = block_attention_mass_paged(q, kc, bt, sl, kv_layout=layout, backend="triton",
                                     attention_reduce=attention_reduce)
    exact, lowp, _ = _references(q, kc, bt, sl, layout, attention_reduce)
    _assert_within_bound(got, exact, lowp, dtype)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=triton_only)])
def test_empty_window_and_empty_batch(backend):
    q, kc, bt, sl = _make_case([20, 40], 1, 2, 1, 16, 16, torch.float32, "NHD")
    empty_w = block_attention_mass_paged(q[:, :0], kc, bt, sl, backend=backend)
    assert empty_w.shape == (2, 0, bt.shape[1])
    out = torch.full((0, 1, bt.shape[1]), 3.0)
    got = block_attention_mass_paged(q[:0], kc, bt[:0], sl[:0], backend=backend, out=out)
    assert got.shape == (0, 1, bt.shape[1])


@triton_only
def test_triton_many_chunks_and_splits(monkeypatch):
    """Blocks spanning several statistics chunks, handled by one program or by many."""
    seq_lens = [16 * 40 + 3, 16 * 17, 9]
    q, kc, bt, sl = _make_case(seq_lens, 8, 4, 1, 16, 16, torch.bfloat16, "HND", q_scale=3.0)
    exact, lowp, _ = _references(q, kc, bt, sl, "HND")
    one = block_attention_mass_paged(q, kc, bt, sl, kv_layout="HND", backend="triton")
    monkeypatch.setattr(_launch, "num_programs_target", lambda device: 1000)
    many = block_attention_mass_paged(q, kc, bt, sl, kv_layout="HND", backend="triton")
    _assert_within_bound(one, exact, lowp, torch.bfloat16)
    torch.testing.assert_close(many, one, rtol=1e-6, atol=1e-7)


@triton_only
def test_triton_peaked_softmax_has_no_nan():
    q, kc, bt, sl = _make_case([40, 90], 4, 2, 1, 32, 16, torch.float16, "NHD", q_scale=40.0)
    got = block_attention_mass_paged(q, kc, bt, sl, backend="triton")
    assert torch.isfinite(got).all()
    exact, lowp, _ = _references(q, kc, bt, sl, "NHD")
    _assert_within_bound(got, exact, lowp, torch.float16)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=triton_only)])
def test_out_accumulates(backend):
    q, kc, bt, sl = _make_case([5, 40], 4, 4, 2, 32, 16, torch.float32, "NHD")
    base = torch.rand(2, 4, bt.shape[1])
    fresh = block_attention_mass_paged(q, kc, bt, sl, backend=backend)
    out = base.clone()
    ret = block_attention_mass_paged(q, kc, bt, sl, backend=backend, out=out)
    assert ret is out
    torch.testing.assert_close(out, base + fresh, rtol=0, atol=1e-6)
    # Two "layers" into one buffer.
    block_attention_mass_paged(q, kc, bt, sl, backend=backend, out=out)
    torch.testing.assert_close(out, base + 2 * fresh, rtol=0, atol=2e-6)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=triton_only)])
def test_strided_fused_cpu_cache_view(backend):
    """The K half of vLLM's CPU cache ``[num_blocks, Hkv, block_size, 2*D]``: a strided view."""
    q, kc, bt, sl = _make_case([70, 33], 4, 4, 2, 32, 32, torch.float32, "HND")
    fused = torch.cat([kc, torch.randn_like(kc)], dim=-1)
    view = fused[..., :32]
    assert not view.is_contiguous()
    sl = torch.stack([sl, sl], dim=1)[:, 0]  # a strided seq_lens view too
    assert not sl.is_contiguous()
    got = block_attention_mass_paged(q, view, bt, sl, kv_layout="HND", backend=backend)
    want = block_attention_mass_paged(q, kc, bt, sl, kv_layout="HND", backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=triton_only)])
def test_transposed_block_key_view(backend):
    """vLLM's CPU ``vec`` ISAs store each block's keys as ``[D, block_size]``: D-stride != 1."""
    q, kc, bt, sl = _make_case([70, 40], 4, 4, 2, 32, 16, torch.float32, "HND")
    nb, hkv, bs, d = kc.shape
    stored = kc.transpose(-1, -2).contiguous()  # [nb, Hkv, D, bs] in memory
    view = stored.transpose(-1, -2)  # logical [nb, Hkv, bs, D], strides (.., .., 1, bs)
    assert view.stride()[-2:] == (1, bs)
    got = block_attention_mass_paged(q, view, bt, sl, kv_layout="HND", backend=backend)
    want = block_attention_mass_paged(q, kc, bt, sl, kv_layout="HND", backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_auto_backend_resolution(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert ops.resolve_backend("auto", cpu) == "torch"
    assert ops.resolve_backend("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="backend='triton'"):
        ops.resolve_backend("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.resolve_backend("auto", cpu) == ("triton" if ops.HAS_TRITON else "torch")


def test_auto_falls_back_to_torch_for_odd_block_size():
    q, kc, bt, sl = _make_case([20], 2, 2, 1, 16, 6, torch.float32, "NHD")
    got = block_attention_mass_paged(q, kc, bt, sl, backend="auto")
    want = block_attention_mass_paged(q, kc, bt, sl, backend="torch")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if ops.HAS_TRITON:
        with pytest.raises(ValueError, match="power-of-two block size"):
            block_attention_mass_paged(q, kc, bt, sl, backend="triton")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"kv_layout": "NDH"}, "kv_layout"),
        ({"backend": "cuda"}, "backend"),
        ({"queries": torch.zeros(4, 2, 32)}, "queries"),
        ({"queries": torch.zeros(1, 2, 4, 32, dtype=torch.float64)}, "queries"),
        ({"queries": torch.zeros(1, 2, 3, 32)}, "multiple"),
        ({"key_cache": torch.zeros(8, 16, 2, 32, dtype=torch.float16)}, "key_cache dtype"),
        ({"key_cache": torch.zeros(8, 16, 2, 16)}, "head size"),
        ({"block_tables": torch.zeros(2, 4, dtype=torch.int32)}, "block_tables"),
        ({"block_tables": torch.zeros(1, 4)}, "block_tables"),
        ({"seq_lens": torch.zeros(1, dtype=torch.float32)}, "seq_lens"),
        ({"out": torch.zeros(1, 2, 5)}, "out"),
        ({"attention_reduce": "sum"}, "attention_reduce"),
    ],
)
def test_bad_arguments_raise(change, match):
    args: dict[str, Any] = {
        "queries": torch.zeros(1, 2, 4, 32),
        "key_cache": torch.zeros(8, 16, 2, 32),
        "block_tables": torch.ones(1, 4, dtype=torch.int32),
        "seq_lens": torch.tensor([20], dtype=torch.int32),
        "kv_layout": "NHD",
        "backend": "torch",
        "out": None,
    }
    args.update(change)
    with pytest.raises(ValueError, match=match):
        block_attention_mass_paged(
            args.pop("queries"), args.pop("key_cache"), args.pop("block_tables"),
            args.pop("seq_lens"), **args,
        )  # fmt: skip


def test_torch_backend_rejects_overlong_seq_len():
    q, kc, bt, _ = _make_case([20], 2, 2, 1, 16, 16, torch.float32, "NHD", spare_blocks=0)
    with pytest.raises(ValueError, match="seq_lens"):
        block_attention_mass_paged(
            q, kc, bt, torch.tensor([40], dtype=torch.int32), backend="torch"
        )


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=triton_only)])
def test_under_torch_compile(backend):
    q, kc, bt, sl = _make_case([30, 50], 4, 4, 2, 32, 16, torch.float32, "NHD")

    def score(q, kc, bt, sl):
        out = torch.zeros(2, 4, bt.shape[1])
        block_attention_mass_paged(q, kc, bt, sl, backend=backend, out=out)
        fresh = block_attention_mass_paged(q, kc, bt, sl, backend=backend)
        peak = torch.full((2, 4, bt.shape[1]), 0.25)
        block_attention_mass_paged(q, kc, bt, sl, backend=backend, out=peak, attention_reduce="max")
        return out + fresh, peak

    torch._dynamo.reset()
    compiled = torch.compile(score, backend="aot_eager", fullgraph=True)
    summed, peak = compiled(q, kc, bt, sl)
    want = 2 * block_attention_mass_paged(q, kc, bt, sl, backend="torch")
    torch.testing.assert_close(summed, want, rtol=1e-5, atol=1e-6)
    want_peak = block_attention_mass_paged(q, kc, bt, sl, backend="torch", attention_reduce="max")
    torch.testing.assert_close(peak, want_peak.clamp(min=0.25), rtol=1e-5, atol=1e-6)


def test_opcheck_fake_impls():
    q, kc, bt, sl = _make_case([30, 50], 4, 4, 2, 32, 16, torch.float32, "NHD")
    torch.library.opcheck(
        torch.ops.nexus_vllm.block_attention_mass_paged.default,
        (q, kc, bt, sl, "NHD", "torch", "mean"),
        test_utils=("test_schema", "test_faketensor"),
    )
    torch.library.opcheck(
        torch.ops.nexus_vllm.block_attention_mass_paged_add_.default,
        (q, kc, bt, sl, torch.zeros(2, 4, bt.shape[1]), "NHD", "torch", "max"),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_public_api():
    """The package re-exports ``ops.__all__`` (one list), the very same objects."""
    import nexus_vllm.kernels as pkg

    assert pkg.__all__ == [
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
    for name in pkg.__all__:
        assert getattr(pkg, name) is getattr(ops, name), name
    # The choices the ops accept are core's, not a copy.
    assert ops.ATTENTION_REDUCES is scoring.ATTENTION_REDUCES and ops.KV_LAYOUTS is scoring.KV_LAYOUTS


def test_imports_without_triton():
    """The package must import (and score via torch) where triton is missing."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from nexus_vllm.kernels import HAS_TRITON, block_attention_mass_paged, resolve_backend\n"
        "assert not HAS_TRITON\n"
        "assert resolve_backend('auto', torch.device('cpu')) == 'torch'\n"
        "q = torch.randn(1, 2, 2, 16); kc = torch.randn(4, 16, 1, 16)\n"
        "m = block_attention_mass_paged(q, kc, torch.tensor([[1, 2]], dtype=torch.int32),\n"
        "    torch.tensor([20], dtype=torch.int32))\n"
        "assert abs(float(m.sum()) - 2.0) < 1e-5\n"
        "print('ok')\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


# ---------------------------------------------------------------------------------------
# GPU-only: realistic shapes, native fp16/bf16 tl.dot, compiled kernels.
# ---------------------------------------------------------------------------------------

GPU_SHAPES = [
    # (seq_lens, W, Hq, Hkv, D)
    ([4096, 1000, 17], 16, 32, 8, 128),
    ([8192], 32, 64, 8, 128),
    ([300, 2500], 32, 28, 4, 128),
]
# Full dtype x block-size x layout matrix on the first shape; the larger shapes in bf16
# (vLLM's GPU default) with both layouts. Kept small: each combination compiles a kernel.
GPU_CASES = [
    (GPU_SHAPES[0], dtype, bs, layout)
    for dtype in DTYPES
    for bs in BLOCK_SIZES
    for layout in KV_LAYOUTS
] + [(shape, torch.bfloat16, 16, layout) for shape in GPU_SHAPES[1:] for layout in KV_LAYOUTS]


@pytest.mark.gpu
@needs_cuda
@triton_only
@pytest.mark.parametrize(("case", "dtype", "block_size", "kv_layout"), GPU_CASES)
def test_gpu_matches_reference(case, dtype, block_size, kv_layout):
    seq_lens, w, hq, hkv, d = case
    q, kc, bt, sl = _make_case(seq_lens, w, hq, hkv, d, block_size, dtype, kv_layout, device="cuda")
    got = block_attention_mass_paged(q, kc, bt, sl, kv_layout=kv_layout, backend="auto")
    exact, lowp, _ = _references(q, kc, bt, sl, kv_layout)
    _assert_within_bound(got, exact, lowp, dtype)
    out = torch.ones_like(got)
    block_attention_mass_paged(q, kc, bt, sl, kv_layout=kv_layout, out=out)
    torch.testing.assert_close(out, got + 1, rtol=0, atol=1e-6)


# attention_reduce="max" (the combine launch's HEAD_MAX build): one case per dtype of note.
GPU_MAX_CASES = [
    (GPU_SHAPES[0], torch.bfloat16, 16, "HND"),
    (GPU_SHAPES[2], torch.float16, 32, "NHD"),
]


@pytest.mark.gpu
@needs_cuda
@triton_only
@pytest.mark.parametrize(("case", "dtype", "block_size", "kv_layout"), GPU_MAX_CASES)
def test_gpu_head_max_matches_reference(case, dtype, block_size, kv_layout):
    seq_lens, w, hq, hkv, d = case
    q, kc, bt, sl = _make_case(seq_lens, w, hq, hkv, d, block_size, dtype, kv_layout, device="cuda")
    got = block_attention_mass_paged(q, kc, bt, sl, kv_layout=kv_layout, backend="auto",
                                     attention_reduce="max")
    exact, lowp, _ = _references(q, kc, bt, sl, kv_layout, "max")
    _assert_within_bound(got, exact, lowp, dtype)
    start = torch.rand(got.shape, device="cuda")
    out = start.clone()
    block_attention_mass_paged(q, kc, bt, sl, kv_layout=kv_layout, out=out, attention_reduce="max")
    torch.testing.assert_close(out, torch.maximum(start, got), rtol=0, atol=0)


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_batched_backend_masks_only_the_tail(monkeypatch, kv_layout):
    """Long rows of different lengths (the mask starts several blocks in, and a shorter row
    has garbage where a longer one has keys): the same result as masking every column."""
    seq_lens = [150, 97, 129]
    q, kc, bt, sl = _make_case(seq_lens, 8, 4, 2, 32, 16, torch.float32, kv_layout)
    bt = bt.clone()
    for i, s in enumerate(sl.tolist()):
        bt[i, num_blocks_for(s, 16) :] = kc.shape[0] + 7  # out of range: must not matter
    assert _reference._first_masked_column(sl.long(), 8, 16, bt.shape[1] * 16) == 80
    tail = block_attention_mass_paged(q, kc, bt, sl, kv_layout=kv_layout, backend="batched")
    monkeypatch.setattr(_reference, "_first_masked_column", lambda *args: 0)
    full = block_attention_mass_paged(q, kc, bt, sl, kv_layout=kv_layout, backend="batched")
    torch.testing.assert_close(tail, full, rtol=0, atol=0)
    _, _, core = _references(q, kc, bt, sl, kv_layout)
    torch.testing.assert_close(tail, core, rtol=0, atol=2e-6)


LAYER_BACKENDS = ["torch", "batched", pytest.param("triton", marks=triton_only)]


@pytest.mark.parametrize("backend", LAYER_BACKENDS)
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_layers_op_sums_the_single_layer_op(backend, kv_layout, monkeypatch):
    """Three layers with their own queries and caches in one call (the plugin's scoring
    step) equal three single-layer calls added up, on every backend."""
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    seq_lens = [0, 40, 97, 130]
    cases = [_make_case(seq_lens, 8, 4, 2, 32, 16, torch.float32, kv_layout) for _ in range(3)]
    _, _, bt, sl = cases[0]
    gen = torch.Generator().manual_seed(SEED + 1)
    queries = torch.stack([torch.randn(q.shape, generator=gen) for q, *_ in cases])
    caches = [torch.randn(kc.shape, generator=gen) for _, kc, _, _ in cases]
    one_by_one = torch.zeros(len(seq_lens), 8, bt.shape[1])
    for q, kc in zip(queries, caches, strict=True):
        block_attention_mass_paged(q, kc, bt, sl, kv_layout=kv_layout, backend="torch",
                                   out=one_by_one)
    got = block_attention_mass_paged_layers(queries, caches, bt, sl, kv_layout=kv_layout,
                                            backend=backend)
    torch.testing.assert_close(got, one_by_one, rtol=0, atol=6e-6)
    again = torch.ones_like(got)
    block_attention_mass_paged_layers(queries, caches, bt, sl, kv_layout=kv_layout,
                                      backend=backend, out=again)
    torch.testing.assert_close(again, got + 1, rtol=0, atol=1e-6)


def test_layers_op_rejects_mismatched_layers():
    q, kc, bt, sl = _make_case([20], 2, 4, 2, 32, 16, torch.float32, "NHD")
    with pytest.raises(ValueError, match=r"queries must be \[L=2"):
        block_attention_mass_paged_layers(q[None], [kc, kc], bt, sl, backend="batched")
    with pytest.raises(ValueError, match="key_cache dtype"):
        block_attention_mass_paged_layers(q[None], [kc.half()], bt, sl, backend="batched")
    # Layers past the first are checked against it (shape, dtype, device).
    qq = torch.stack([q, q])
    with pytest.raises(ValueError, match=r"key_caches\[1\] .* must match key_caches\[0\]"):
        block_attention_mass_paged_layers(qq, [kc, kc.half()], bt, sl, backend="batched")
    with pytest.raises(ValueError, match=r"key_caches\[1\]"):
        block_attention_mass_paged_layers(qq, [kc, kc[:-1]], bt, sl, backend="batched")


def test_batched_backend_chunks_requests(monkeypatch):
    """A tight scratch budget splits the batch into one request per chunk: same result."""
    q, kc, bt, sl = _make_case([50, 7, 33, 0, 80], 4, 4, 2, 32, 16, torch.float32, "HND")
    whole = block_attention_mass_paged(q, kc, bt, sl, kv_layout="HND", backend="batched")
    monkeypatch.setattr(_reference, "_BATCHED_LOGITS", 1)
    split = block_attention_mass_paged(q, kc, bt, sl, kv_layout="HND", backend="batched")
    torch.testing.assert_close(split, whole, rtol=0, atol=0)
