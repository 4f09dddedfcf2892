import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nexus_vllm.core import (
    POLICIES,
    EvictionConfig,
    Evidence,
    forced_blocks,
    get_policy,
    inclusion_probabilities,
    indirect_scores,
    nexus_weights,
)

POLICY_NAMES = sorted(POLICIES)
SAMPLERS = ["pps", "ares", "topk"]


def random_mass(w: int, n: int, seed: int) -> torch.Tensor:
    m = torch.rand(w, n, generator=torch.Generator().manual_seed(seed)) ** 3
    return m / m.sum(dim=1, keepdim=True)


def run_select(name, mass, budget, seed=0, **knobs):
    policy = get_policy(name, **knobs)
    norms = torch.rand(mass.shape[1], generator=torch.Generator().manual_seed(seed)) + 0.5
    return policy.select(
        mass, budget, generator=torch.Generator().manual_seed(seed), state={}, key_norms=norms
    )


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(POLICY_NAMES),
    w=st.integers(1, 16),
    n=st.integers(1, 64),
    sinks=st.integers(1, 4),
    recent=st.integers(0, 4),
    extra=st.integers(0, 30),
    seed=st.integers(0, 10_000),
)
def test_policy_invariants(name, w, n, sinks, recent, extra, seed):
    budget = sinks + recent + 1 + extra
    mass = random_mass(w, n, seed)
    keep = run_select(name, mass, budget, seed, sink_blocks=sinks, recent_blocks=recent)
    assert keep.dtype == torch.long
    assert keep.numel() == min(n, budget)  # exact budget
    assert torch.equal(keep, torch.unique(keep))  # sorted, unique
    assert int(keep.min()) >= 0 and int(keep.max()) < n
    assert set(forced_blocks(n, sinks, recent).tolist()) <= set(keep.tolist())
    again = run_select(name, mass, budget, seed, sink_blocks=sinks, recent_blocks=recent)
    assert torch.equal(keep, again)  # reproducible from the seed


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_nexus_samplers_keep_forced_set(sampler):
    mass = random_mass(16, 40, 1)
    keep = run_select("nexus", mass, 12, sampler=sampler, sink_blocks=2, recent_blocks=3)
    assert keep.numel() == 12
    assert {0, 1, 36, 37, 38, 39} <= set(keep.tolist())


def test_forced_set_contents():
    assert forced_blocks(20, 2, 3).tolist() == [0, 1, 16, 17, 18, 19]
    assert forced_blocks(3, 2, 3).tolist() == [0, 1, 2]


def test_budget_smaller_than_forced_set_is_rejected():
    with pytest.raises(ValueError, match="budget_blocks must be >="):
        get_policy("snapkv", sink_blocks=2, recent_blocks=4).select(random_mass(4, 30, 0), 5)


def test_walk_lifts_bridge_above_single_query_spike():
    w, n = 16, 40
    mass = torch.ones(w, n)  # many background blocks, evenly attended
    bridge, spike = 4, 7
    mass[:, bridge] = 2.2  # moderate support from every window query
    mass[:, spike] = 0.0
    mass[2, spike] = 1000.0  # one older query, and only it, points at it sharply
    mass = mass / mass.sum(dim=1, keepdim=True)
    a = nexus_weights(mass, lam=0.0)
    w_walk = nexus_weights(mass, indirect="walk", lam=0.5)
    assert a[spike] > a[bridge]  # direct attention alone prefers the spike
    assert w_walk[bridge] > w_walk[spike]  # the walk surfaces the bridge
    for mode in ("walk", "ppr"):
        assert indirect_scores(mass, indirect=mode)[bridge] > 0


def test_nexus_weights_modes_and_ramp():
    mass = random_mass(8, 10, 3)
    for mode in ("walk", "ppr", "none"):
        for rows in ("newest", "oldest", "cycle"):
            w = nexus_weights(mass, indirect=mode, walk_rows=rows)
            assert w.shape == (10,) and torch.all(w >= 0)
    flat = nexus_weights(torch.ones(4, 5), indirect="none", eps=1e-6)
    assert torch.all(flat[1:] > flat[:-1])  # the recency ramp breaks ties toward the newest


def test_h2o_accumulates_across_events():
    policy = get_policy("h2o", sink_blocks=1, recent_blocks=0)
    state: dict = {}
    first = torch.zeros(1, 6)
    first[0, 2] = 1.0  # block 2 was heavy in the past...
    policy.select(first, 6, state=state)
    second = torch.zeros(1, 8)
    second[0, 3] = 0.6  # ...block 3 is heavier now, but not in total
    second[0, 4] = 0.4
    keep = policy.select(second, 3, state=state)
    assert keep.tolist() == [0, 2, 7]  # sink, the historic heavy hitter, the current block
    assert state[policy.STATE_KEY].numel() == 3  # re-indexed to the kept blocks


# 4000 Monte Carlo trials of up to 4 policy calls each (~15 s on a 2-core box).
@pytest.mark.slow
def test_topk_kills_intermittent_block_pps_survival_is_product_of_pi():
    """A block just below the cutoff in some events: top-K drops it at the first dip;
    pps keeps it with probability prod(pi) over the events."""
    n, budget, target = 10, 6, 5
    dips = [False, True, False, True]

    def event_mass(dip: bool) -> torch.Tensor:
        weights = torch.tensor([1.0, 3.0, 2.9, 2.8, 2.7, 2.75, 0.5, 0.4, 1.0, 1.0])
        weights[target] = 2.6 if dip else 3.5  # 2.6 < cutoff 2.7 when it dips
        return (weights / weights.sum()).expand(4, n).clone()

    # Fixed stream: the same N blocks are offered each event (evicted ones come back
    # as new arrivals), so survival of `target` is the product over events.
    def survives(policy, generator) -> bool:
        for dip in dips:
            keep = policy.select(event_mass(dip), budget, generator=generator)
            if target not in keep.tolist():
                return False
        return True

    topk = get_policy("nexus", sampler="topk", lam=0.0, sink_blocks=1, recent_blocks=1)
    assert not survives(topk, None)
    pps = get_policy("nexus", sampler="pps", lam=0.0, sink_blocks=1, recent_blocks=1)
    expected = 1.0
    for dip in dips:
        weights = pps.score(Evidence(event_mass(dip)), None)
        candidates = torch.arange(1, n - 2)  # minus sink and the 2 forced newest
        pi = inclusion_probabilities(weights[candidates], budget - 3)
        expected *= float(pi[target - 1])
    trials = 4000
    g = torch.Generator().manual_seed(0)
    rate = sum(survives(pps, g) for _ in range(trials)) / trials
    assert 0.0 < expected < 1.0
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / trials) ** 0.5 + 1e-3


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: get_policy("lru"), "policy must be one of"),
        (lambda: get_policy("nexus", lamda=0.5), "unknown knob"),
        (lambda: get_policy("nexus", lam=-1.0), "lam"),
        (lambda: get_policy("nexus", steps=0), "steps"),
        (lambda: get_policy("nexus", sampler="gumbel"), "sampler"),
        (lambda: get_policy("nexus", indirect="pagerank"), "indirect"),
        (lambda: get_policy("h2o", sink_blocks=0), "sink_blocks"),
        (lambda: get_policy("knorm").select(random_mass(2, 20, 0), 8), "key_norms"),
        (lambda: get_policy("tova").select(torch.full((2, 3), float("nan")), 2), "finite"),
    ],
)
def test_bad_policy_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_eviction_config():
    cfg = EvictionConfig(method="nexus", max_tokens=1024, block_size=32)
    assert cfg.enabled and cfg.budget_blocks(100_000) == 32
    ratio = EvictionConfig(keep_ratio=0.2)
    assert ratio.budget_blocks(64) == ratio.num_forced  # never below the forced set
    assert ratio.budget_blocks(32 * 100) == 20
    assert (
        not EvictionConfig().enabled and not EvictionConfig(method="none", max_tokens=512).enabled
    )
    assert ratio.policy(prefill=True).indirect == "walk" and ratio.policy().indirect == "walk"
    assert EvictionConfig.from_dict({"method": "tova", "max_tokens": 512}).method == "tova"
    g1, g2 = cfg.generator("req-1"), cfg.generator("req-1")
    assert torch.equal(torch.rand(3, generator=g1), torch.rand(3, generator=g2))
    assert cfg.generator("req-1").initial_seed() != cfg.generator("req-2").initial_seed()
    assert cfg.replace(seed=3).seed == 3
    assert list(cfg.scored_layers(6)) == [2, 3, 4, 5]
    assert list(cfg.replace(layer_stride=2).scored_layers(6)) == [2, 4]
    assert list(cfg.replace(layer_stride=3).scored_layers(7)) == [2, 5]
    assert list(cfg.replace(skip_layers=6).scored_layers(6)) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"method": "lru"}, "method"),
        ({"max_tokens": 512, "keep_ratio": 0.5}, "at most one"),
        ({"max_tokens": 64}, "max_tokens must be >="),
        ({"keep_ratio": 0.0}, "keep_ratio"),
        ({"keep_ratio": 1.5}, "keep_ratio"),
        ({"block_size": 0}, "block_size"),
        ({"layer_stride": 0}, "layer_stride"),
        ({"sampler": "x"}, "sampler"),
        ({"n": 0}, "n must be"),
        ({"prefill_indirect": "hub"}, "prefill_indirect='hub' was removed"),
        ({"indirect": "hub"}, "indirect='hub' was removed"),
        ({"prefill_indirect": "walks"}, "prefill_indirect must be one of"),
    ],
)
def test_bad_eviction_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EvictionConfig(**kwargs)


def test_eviction_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown eviction config key"):
        EvictionConfig.from_dict({"method": "nexus", "budget": 3})
    with pytest.raises(ValueError, match="unknown eviction config key"):
        EvictionConfig().replace(budget=3)
