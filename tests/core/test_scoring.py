import math

import pytest
import torch

from nexus_vllm.core import (
    block_attention_mass,
    block_attention_mass_paged,
    combine_layer_masses,
    normalize_rows,
    num_blocks_for,
)

# (W, Hq, Hkv, D, T, block_size)
SHAPES = [
    (1, 1, 1, 8, 1, 4),
    (4, 4, 2, 16, 37, 8),
    (16, 9, 3, 64, 200, 32),
    (8, 8, 8, 32, 64, 16),
    (32, 4, 1, 16, 33, 32),
]


def naive_mass(q: torch.Tensor, k: torch.Tensor, block_size: int,
               attention_reduce: str = "mean") -> torch.Tensor:
    """Loop-per-query/head version of the definition, in float64."""
    w, hq, d = q.shape
    t, hkv, _ = k.shape
    group = hq // hkv
    n = math.ceil(t / block_size)
    per_head = torch.zeros(hq, w, n, dtype=torch.float64)
    for i in range(w):
        pos = t - w + i
        for h in range(hq):
            logits = k[: pos + 1, h // group].double() @ q[i, h].double() / math.sqrt(d)
            p = torch.softmax(logits, dim=0)
            for j in range(n):
                per_head[h, i, j] = p[j * block_size : (j + 1) * block_size].sum()
    return per_head.mean(0) if attention_reduce == "mean" else per_head.max(0).values


@pytest.mark.parametrize("shape", SHAPES)
def test_mass_matches_definition(shape):
    w, hq, hkv, d, t, b = shape
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(w, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    got = block_attention_mass(q, k, b)
    assert got.dtype == torch.float32
    assert got.shape == (w, num_blocks_for(t, b))
    torch.testing.assert_close(got.double(), naive_mass(q, k, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.sum(dim=1), torch.ones(w), atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_max_over_heads_matches_definition(shape):
    w, hq, hkv, d, t, b = shape
    g = torch.Generator().manual_seed(sum(shape) + 1)
    q = torch.randn(w, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    got = block_attention_mass(q, k, b, attention_reduce="max")
    torch.testing.assert_close(got.double(), naive_mass(q, k, b, "max"), atol=1e-5, rtol=1e-5)
    mean = block_attention_mass(q, k, b)
    assert bool((got >= mean - 1e-6).all())  # the max of the heads is at least their mean
    if hq == 1:
        torch.testing.assert_close(got, mean)


def test_combined_layers_mean_sums_to_one_and_max_keeps_one_heads_focus():
    g = torch.Generator().manual_seed(3)
    layers = [torch.rand(4, 6, generator=g) for _ in range(3)]
    layers = [normalize_rows(m) for m in layers]
    mean = combine_layer_masses(layers, "mean")
    torch.testing.assert_close(mean, torch.stack(layers).mean(0))
    torch.testing.assert_close(mean.sum(1), torch.ones(4))
    # The max is the layers' elementwise maximum as softmax gave it: rows sum past 1.
    maxima = combine_layer_masses(layers, "max")
    assert torch.equal(maxima, torch.stack(layers).amax(0))
    assert bool((maxima.sum(1) > 1).all())
    # One layer's sharp focus on block 2 survives the max, and is diluted by the mean.
    sharp = torch.full((1, 6), 0.01)
    sharp[0, 2] = 0.95
    flat = [torch.full((1, 6), 1 / 6) for _ in range(5)]
    assert combine_layer_masses([sharp, *flat], "max")[0, 2] > 0.5 > \
        combine_layer_masses([sharp, *flat], "mean")[0, 2]
    # A query that saw nothing stays all zeros.
    zero = combine_layer_masses([torch.zeros(1, 3)], "max")
    assert torch.equal(zero, torch.zeros(1, 3))
    with pytest.raises(ValueError, match="attention_reduce"):
        combine_layer_masses(layers, "sum")
    with pytest.raises(ValueError, match="at least one layer"):
        combine_layer_masses([], "max")


def test_mass_is_causal():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 2, 8, generator=g), torch.randn(16, 1, 8, generator=g)
    mass = block_attention_mass(q, k, 1)
    # Query i (position 12 + i) must not see keys after it.
    for i in range(4):
        assert torch.all(mass[i, 12 + i + 1 :] == 0)
        assert mass[i, 12 + i] > 0


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("shape", SHAPES[1:])
def test_paged_equals_contiguous(shape, layout):
    w, hq, hkv, d, t, b = shape
    g = torch.Generator().manual_seed(7)
    q = torch.randn(w, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    n = num_blocks_for(t, b)
    num_pool = 3 * n + 5  # an oversized pool, blocks scattered in it
    table = torch.randperm(num_pool, generator=g)[: n + 2].to(torch.int32)
    cache = torch.randn(num_pool, b, hkv, d, generator=g)
    padded = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, n * b - t))
    cache[table[:n].long()] = padded.view(n, b, hkv, d)
    if layout == "HND":
        cache = cache.transpose(1, 2).contiguous()
    got = block_attention_mass_paged(q, cache, table, t, kv_layout=layout)
    torch.testing.assert_close(got, block_attention_mass(q, k, b), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"block_size": 0}, "block_size"),
        ({"keys": torch.randn(10, 3, 8)}, "multiple of KV heads"),
        ({"queries": torch.randn(20, 4, 8)}, "window"),
        ({"keys": torch.randn(10, 2, 4)}, "head size"),
        ({"attention_reduce": "sum"}, "attention_reduce"),
    ],
)
def test_mass_rejects_bad_input(kwargs, match):
    args = {"queries": torch.randn(4, 4, 8), "keys": torch.randn(10, 2, 8), "block_size": 4}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        block_attention_mass(**args)


def test_paged_rejects_short_table_and_bad_layout():
    cache = torch.randn(4, 4, 1, 8)
    with pytest.raises(ValueError, match="block_table"):
        block_attention_mass_paged(torch.randn(1, 1, 8), cache, torch.tensor([0]), 9)
    with pytest.raises(ValueError, match="kv_layout"):
        block_attention_mass_paged(torch.randn(1, 1, 8), cache, torch.tensor([0]), 2, kv_layout="X")
