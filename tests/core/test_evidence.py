"""The evidence registry and its kinds: each kind's worker gatherer (paged, batched, split
over TP ranks) against its transformers-path gatherer, expected attention against an
explicit evaluation of its formula, and the rotary table against transformers' RoPE.
Seeded; shapes at module level."""

from __future__ import annotations

import functools

import pytest
import torch

from nexus_vllm.core import (
    ATTENTION_REDUCES,
    EVIDENCE_KINDS,
    Evidence,
    Rotary,
    evidence_kind,
    register_evidence,
)
from nexus_vllm.core.evidence import DenseLayer, DenseSequence, EvidenceKind, PagedBatch
from nexus_vllm.core.evidence.key_norms import block_key_norms
from nexus_vllm.kernels import block_attention_mass_paged_layers

# (query heads, KV heads, head size, block size)
HEAD_SHAPES = [(4, 2, 16, 8), (6, 3, 8, 4), (2, 2, 32, 16)]
# (sequence lengths of the batch's requests, window rows of each)
BATCHES = [((37, 64, 9), (8, 5, 3)), ((100,), (8,))]


def _rotary(head_size: int, positions: int = 4096) -> Rotary:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_size, 2).float() / head_size))
    return Rotary.from_inv_freq(inv_freq, positions, head_size=head_size)


def _rope(x: torch.Tensor, positions: torch.Tensor, head_size: int) -> torch.Tensor:
    """Llama's RoPE as transformers applies it (``x [W, H, D]``)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_size, 2).float() / head_size))
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]  # [1, 1, W, D]
    q = x.permute(1, 0, 2)[None]  # [1, H, W, D]
    out, _ = apply_rotary_pos_emb(q, q, cos[0, 0], sin[0, 0], unsqueeze_dim=0)
    return out[0].permute(1, 0, 2)


def test_registry_holds_the_built_in_kinds():
    assert {"mass", "key_norms"} <= set(EVIDENCE_KINDS)
    assert evidence_kind("mass").layout == "rows" and evidence_kind("mass").reads_queries
    assert evidence_kind("key_norms").layout == "blocks"
    with pytest.raises(ValueError, match="unknown evidence kind 'bogus'"):
        evidence_kind("bogus")
    with pytest.raises(ValueError, match="already registered"):
        register_evidence(type(EVIDENCE_KINDS["mass"])())


def test_evidence_is_a_validated_mapping():
    mass = torch.softmax(torch.randn(2, 5, generator=torch.Generator().manual_seed(0)), -1)
    ev = Evidence(mass, torch.ones(5))
    assert ev.holds == {"mass", "key_norms"} and ev.num_blocks == 5 and len(ev) == 2
    assert torch.equal(ev["key_norms"], torch.ones(5))
    with pytest.raises(ValueError, match="key_norms must be 5 finite values"):
        Evidence(mass, torch.ones(4))
    with pytest.raises(ValueError, match="mass must be"):
        Evidence(num_blocks=5, mass=torch.ones(2, 4) / 4)
    with pytest.raises(ValueError, match="unknown evidence kind"):
        Evidence(mass, nonsense=torch.ones(5))
    with pytest.raises(ValueError, match="needs num_blocks"):
        Evidence()
    empty = Evidence(num_blocks=7)
    assert empty.holds == frozenset() and empty.num_blocks == 7
    with pytest.raises(KeyError, match="holds no 'mass'"):
        _ = empty.mass
    # Gathered maxima: mass rows renormalised, their totals kept.
    ev = Evidence.from_gathered({"mass": torch.tensor([[0.5, 1.0, 0.5]])}, attention_reduce="max")
    torch.testing.assert_close(ev.mass, torch.tensor([[0.25, 0.5, 0.25]]))
    torch.testing.assert_close(ev.row_scale, torch.tensor([2.0]))
    assert Evidence.from_gathered({"mass": mass}, attention_reduce="mean").row_scale is None


@pytest.mark.parametrize("head_size", [8, 32])
def test_rotary_table_inverts_and_averages_transformers_rope(head_size):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, head_size, generator=g)
    pos = torch.tensor([0, 5, 17, 300, 1000, 2047])
    rotary = _rotary(head_size)
    rotated = _rope(x, pos, head_size)
    torch.testing.assert_close(rotary.unrotate(rotated, pos), x, atol=1e-4, rtol=1e-4)
    # One position: the mean rotation is that position's rotation.
    for p in (0, 9, 700):
        mat = rotary.mean_rotation(torch.tensor([p]), 1)[0]
        want = _rope(x, torch.full((6,), p), head_size)
        torch.testing.assert_close(torch.einsum("de,whe->whd", mat, x), want,
                                   atol=1e-4, rtol=1e-4)
    # Many: the mean of the matrices, each rebuilt from transformers' RoPE of a basis.
    eye = torch.eye(head_size).view(head_size, 1, head_size)
    mats = [_rope(eye, torch.full((head_size,), p), head_size)[:, 0, :].T
            for p in range(40, 48)]
    torch.testing.assert_close(rotary.mean_rotation(torch.tensor([40]), 8)[0],
                               torch.stack(mats).mean(0), atol=1e-4, rtol=1e-4)


def _paged(keys_per_req, block_size, g):
    """A shuffled paged cache ``[num_blocks, Hkv, bs, D]`` holding each request's keys,
    and the block tables (``HND``, as the worker reads it)."""
    hkv, d = keys_per_req[0].shape[1:]
    counts = [-(-k.shape[0] // block_size) for k in keys_per_req]
    total = sum(counts) + 3
    perm = torch.randperm(total, generator=g)
    cache = torch.randn(total, hkv, block_size, d, generator=g)
    n_max = max(counts)
    tables = torch.zeros(len(keys_per_req), n_max + 2, dtype=torch.int32)
    used = 0
    for r, keys in enumerate(keys_per_req):
        for j in range(counts[r]):
            blk = int(perm[used])
            used += 1
            tables[r, j] = blk
            part = keys[j * block_size:(j + 1) * block_size]
            cache[blk, :, :part.shape[0]] = part.transpose(0, 1)
    return cache, tables, n_max


@pytest.mark.parametrize("attention_reduce", ATTENTION_REDUCES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("shape", HEAD_SHAPES)
@pytest.mark.parametrize("kind_name", list(EVIDENCE_KINDS))
def test_paged_gatherer_split_over_ranks_matches_dense(kind_name, shape, batch, attention_reduce):
    """Every kind's worker gatherer, on two layers split over two TP ranks (each with half
    the heads) and reduced as the kind declares, gives its transformers-path gatherer."""
    hq, hkv, d, bs = shape
    lens, windows = batch
    kind: EvidenceKind = evidence_kind(kind_name)
    g = torch.Generator().manual_seed(hash((kind_name, shape, lens)) % 2**31)
    layers = 2
    rotary = _rotary(d)
    w_s = max(windows)
    keys = [[_rope(torch.randn(t, hkv, d, generator=g), torch.arange(t), d)
             for t in lens] for _ in range(layers)]
    queries = torch.zeros(layers, len(lens), w_s, hq, d)
    for li in range(layers):
        for r, t in enumerate(lens):
            pos = torch.arange(t - w_s, t).clamp(min=0)
            queries[li, r] = _rope(torch.randn(w_s, hq, d, generator=g), pos, d)
    caches_tables = [_paged(keys[li], bs, torch.Generator().manual_seed(li)) for li in
                     range(layers)]
    # The same tables for every layer: rebuild each layer's cache on layer 0's tables.
    cache0, tables, n_max = caches_tables[0]
    caches = [cache0]
    for li in range(1, layers):
        c = torch.randn_like(cache0)
        for r, t in enumerate(lens):
            for j in range(-(-t // bs)):
                part = keys[li][r][j * bs:(j + 1) * bs]
                c[int(tables[r, j]), :, :part.shape[0]] = part.transpose(0, 1)
        caches.append(c)
    positions = torch.tensor([[t - w_s + i for i in range(w_s)] for t in lens]).clamp(min=0)
    tp = 2 if hkv % 2 == 0 else 1
    op = kind.rank_reduce(attention_reduce)
    layout_shape = ((len(lens), w_s, n_max) if kind.layout == "rows" else (len(lens), n_max))
    total = None
    for rank in range(tp):
        hk, hqr = hkv // tp, hq // tp
        part = torch.zeros(layout_shape)
        kind.gather_paged(PagedBatch(
            queries=queries[..., rank * hqr:(rank + 1) * hqr, :],
            rows=torch.tensor(windows), query_positions=positions,
            next_positions=torch.tensor(lens),
            key_caches=[c[:, rank * hk:(rank + 1) * hk] for c in caches],
            tables=tables, seq_lens=torch.tensor(lens, dtype=torch.int32),
            attention_reduce=attention_reduce, layers_divisor=layers * tp, rotary=rotary,
            paged_mass=functools.partial(block_attention_mass_paged_layers, backend="torch")),
            part)
        if total is None:
            total = part
        else:
            total = total + part if op == "sum" else torch.maximum(total, part)
    assert total is not None
    for r, t in enumerate(lens):
        w = windows[r]
        seq = DenseSequence(
            layers=[DenseLayer(queries=queries[li, r, w_s - w:], keys=keys[li][r])
                    for li in range(layers)],
            block_size=bs, attention_reduce=attention_reduce,
            query_positions=positions[r, w_s - w:], next_position=t, rotary=rotary)
        want = kind.gather_dense(seq)
        n = -(-t // bs)
        got = total[r, w_s - w:, :n] if kind.layout == "rows" else total[r, :n]
        got_parts, want_parts = kind.finish(got, attention_reduce), kind.finish(want, attention_reduce)
        assert set(got_parts) == set(want_parts)
        for name, value in want_parts.items():
            torch.testing.assert_close(got_parts[name], value, atol=2e-5, rtol=1e-4)


def test_block_key_norms_reference():
    keys = torch.arange(2 * 5 * 1 * 2, dtype=torch.float32).view(2, 5, 1, 2)
    per_token = keys.norm(dim=-1).mean(dim=(0, 2))
    want = torch.stack([per_token[:2].mean(), per_token[2:4].mean(), per_token[4:].mean()])
    torch.testing.assert_close(block_key_norms(keys, 2), want)
