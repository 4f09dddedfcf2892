import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from nexus_vllm.core import inclusion_probabilities, sample_blocks

WEIGHT_VECTORS = [
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    [5.0, 1.0, 1.0, 1.0, 0.1, 0.1, 3.0, 0.0],  # one overweight block, a zero
    [100.0, 50.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],  # two overweight
    [0.01, 0.02, 0.5, 0.3, 0.3, 0.05, 0.9, 0.2, 0.4, 0.1, 0.7, 0.25],
]
KS = [1, 3, 5]
DRAWS = 20_000


@pytest.mark.parametrize("weights", WEIGHT_VECTORS)
@pytest.mark.parametrize("k", KS)
def test_inclusion_probabilities_sum_and_cap(weights, k):
    w = torch.tensor(weights)
    if k > w.numel():
        pytest.skip("k > N")
    pi = inclusion_probabilities(w, k)
    assert float(pi.sum()) == pytest.approx(k, abs=1e-9)
    assert torch.all((pi >= 0) & (pi <= 1))
    capped = pi >= 1 - 1e-12
    free = ~capped & (w > 0)
    if free.any():  # uncapped items are proportional to weight
        ratio = pi[free] / w[free].double()
        assert torch.allclose(ratio, ratio[0].expand_as(ratio))
        # and every capped item would have exceeded 1 at that scale
        assert torch.all(w[capped].double() * ratio[0] >= 1 - 1e-9)


def _empirical_inclusion(weights: list[float], k: int, draws: int) -> torch.Tensor:
    """Fraction of ``draws`` pps draws that keep each item, Tensor[N] (float64)."""
    w = torch.tensor(weights)
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(w.numel(), dtype=torch.float64)
    for _ in range(draws):  # one sample_blocks call per draw: the code under test
        counts[sample_blocks(w, k, sampler="pps", generator=g)] += 1
    return counts / draws


# Monte Carlo over every (weights, k): ~3 min on a 2-core box, so in the slow tier.
@pytest.mark.slow
@pytest.mark.parametrize("weights", WEIGHT_VECTORS)
@pytest.mark.parametrize("k", KS)
def test_pps_empirical_inclusion_matches_pi(weights, k):
    pi = inclusion_probabilities(torch.tensor(weights), k)
    assert torch.max(torch.abs(_empirical_inclusion(weights, k, DRAWS) - pi)) < 0.01


def test_pps_empirical_inclusion_matches_pi_quick():
    """The fast tier's check of the same property: one case with two capped items, fewer
    draws, and a per-item bound of 4 standard errors of the empirical frequency."""
    weights, k, draws = WEIGHT_VECTORS[2], 3, 2000
    pi = inclusion_probabilities(torch.tensor(weights), k)
    assert int((pi == 1.0).sum()) == 2  # the case exercises capping
    bound = 4 * torch.sqrt(pi * (1 - pi) / draws) + 1e-9
    assert torch.all(torch.abs(_empirical_inclusion(weights, k, draws) - pi) <= bound)


@pytest.mark.slow
@pytest.mark.parametrize("weights", WEIGHT_VECTORS[1:])
def test_horvitz_thompson_is_unbiased(weights):
    w = torch.tensor(weights)
    k = 3
    pi = inclusion_probabilities(w, k)
    x = torch.linspace(1.0, 4.0, w.numel(), dtype=torch.float64)  # any per-block quantity
    eligible = pi > 0
    g = torch.Generator().manual_seed(99)
    estimates = []
    for _ in range(DRAWS):
        kept = sample_blocks(w, k, generator=g)
        estimates.append(float((x[kept] / pi[kept]).sum()))
    est = torch.tensor(estimates, dtype=torch.float64)
    truth = float(x[eligible].sum())
    stderr = float(est.std()) / DRAWS**0.5
    assert abs(float(est.mean()) - truth) < 4 * stderr + 1e-9


@pytest.mark.slow
def test_ares_n1_is_gumbel_top_k_in_distribution():
    w = torch.tensor([4.0, 2.0, 1.0, 1.0, 0.5, 0.25])
    k, draws = 2, 20_000
    g = torch.Generator().manual_seed(5)
    ares_sets: dict[tuple[int, ...], int] = {}
    for _ in range(draws):
        s = tuple(sample_blocks(w, k, sampler="ares", n=1, generator=g).tolist())
        ares_sets[s] = ares_sets.get(s, 0) + 1
    # The reference, Gumbel-top-k, all draws at once (its own generator: independent).
    u = torch.rand(draws, w.numel(), generator=torch.Generator().manual_seed(6),
                   dtype=torch.float64)
    top = torch.topk(torch.log(w.double()) - torch.log(-torch.log(u)), k, dim=1).indices
    gumbel_sets: dict[tuple[int, ...], int] = {}
    for t in torch.sort(top, dim=1).values.tolist():
        gumbel_sets[tuple(t)] = gumbel_sets.get(tuple(t), 0) + 1
    keys = sorted(set(ares_sets) | set(gumbel_sets))
    table = [[ares_sets.get(s, 0) for s in keys], [gumbel_sets.get(s, 0) for s in keys]]
    assert stats.chi2_contingency(table).pvalue > 0.001


def test_ares_inclusion_is_not_proportional():
    # The spec's warning: A-Res keeps heavy items more often than pi says.
    w = torch.tensor([8.0, 1.0, 1.0, 1.0, 1.0])
    pi = inclusion_probabilities(w, 2)
    g = torch.Generator().manual_seed(3)
    hits = sum(int(0 in sample_blocks(w, 2, sampler="ares", n=1, generator=g)) for _ in range(5000))
    assert pi[0] == 1.0 and hits / 5000 < 0.99


def test_ares_n_depends_on_weights_not_their_scale():
    w = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.25, 0.1])
    a = sample_blocks(w, 3, sampler="ares", n=4, generator=torch.Generator().manual_seed(1))
    b = sample_blocks(w * 1000, 3, sampler="ares", n=4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)


def test_topk_is_deterministic_and_stable():
    w = torch.tensor([1.0, 3.0, 3.0, 2.0, 0.0])
    assert sample_blocks(w, 2, sampler="topk").tolist() == [1, 2]
    assert sample_blocks(torch.ones(5), 2, sampler="topk").tolist() == [0, 1]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    data=st.data(),
    sampler=st.sampled_from(["pps", "ares", "topk"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_sampler_invariants(n, data, sampler, seed):
    weights = torch.tensor(
        data.draw(st.lists(st.floats(0.0, 1e3), min_size=n, max_size=n)), dtype=torch.float64
    )
    k = data.draw(st.integers(0, n))
    first = sample_blocks(
        weights, k, sampler=sampler, n=3, generator=torch.Generator().manual_seed(seed)
    )
    again = sample_blocks(
        weights, k, sampler=sampler, n=3, generator=torch.Generator().manual_seed(seed)
    )
    assert first.dtype == torch.long and first.numel() == k
    assert torch.equal(first, again)
    assert torch.equal(first, torch.unique(first))  # sorted and unique
    assert k == 0 or (int(first.min()) >= 0 and int(first.max()) < n)
    pi = inclusion_probabilities(weights, k)
    if sampler == "pps":  # certain items (pi == 1) are always drawn
        assert set(torch.nonzero(pi >= 1.0).flatten().tolist()) <= set(first.tolist())


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: inclusion_probabilities(torch.tensor([1.0, 2.0]), 3), "k must be <="),
        (lambda: inclusion_probabilities(torch.tensor([1.0, -2.0]), 1), "non-negative"),
        (lambda: inclusion_probabilities(torch.tensor([1.0, float("nan")]), 1), "finite"),
        (lambda: inclusion_probabilities(torch.ones(2, 2), 1), "1-D"),
        (lambda: sample_blocks(torch.ones(3), 1, sampler="gumbel"), "sampler"),
        (lambda: sample_blocks(torch.ones(3), 1, sampler="ares", n=0), "n must be"),
        (lambda: sample_blocks(torch.ones(3), -1), "k must be"),
    ],
)
def test_bad_input_raises_naming_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "weights, k",
    [
        ([0.0, 0.0, 1.0, 2.225073858507203e-309, 5e-324], 2),  # subnormals (found by hypothesis)
        ([1e300, 1e-300, 1e-300, 0.0], 3),
        ([4.0, 4.0, 0.0, 0.0], 3),  # capping uses up the positives, zeros share the rest
    ],
)
def test_inclusion_probabilities_extreme_weights(weights, k):
    pi = inclusion_probabilities(torch.tensor(weights, dtype=torch.float64), k)
    assert torch.all(torch.isfinite(pi)) and torch.all((pi >= 0) & (pi <= 1))
    assert float(pi.sum()) == pytest.approx(k, abs=1e-9)
    kept = sample_blocks(
        torch.tensor(weights, dtype=torch.float64), k, generator=torch.Generator().manual_seed(0)
    )
    assert kept.numel() == k
