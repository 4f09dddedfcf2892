import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nexus_vllm.core import (
    METHODS,
    POLICIES,
    ConfigError,
    EvictionConfig,
    Evidence,
    direct_scores,
    forced_blocks,
    get_policy,
    inclusion_probabilities,
    indirect_scores,
    nexus_weights,
)
from nexus_vllm.core.budget import budget_blocks
from tests.core.policy_cases import (
    HAND_BUDGET,
    HAND_EVIDENCE,
    HAND_FORCED,
    HAND_RECENT,
    HAND_SINKS,
    POLICY_CASES,
    PolicyCase,
)

SAMPLERS = ["pps", "ares", "topk"]


def random_mass(w: int, n: int, seed: int) -> torch.Tensor:
    m = torch.rand(w, n, generator=torch.Generator().manual_seed(seed)) ** 3
    return m / m.sum(dim=1, keepdim=True)


def run_select(name, mass, budget, seed=0, **knobs):
    policy = get_policy(name, **knobs)
    gen = torch.Generator().manual_seed(seed)
    norms = torch.rand(mass.shape[1], generator=gen) + 0.5
    expected = torch.rand(mass.shape[1], generator=gen)
    evidence = Evidence(mass, norms, expected_attention=expected / expected.sum())
    return policy.select(evidence, budget, generator=torch.Generator().manual_seed(seed),
                         state={})


# -- the case table ------------------------------------------------------------------
def test_case_table_covers_every_policy():
    names = [case.name for case in POLICY_CASES]
    assert sorted(names) == sorted(POLICIES) and len(set(names)) == len(names)
    assert ("none", *POLICIES) == METHODS


@pytest.mark.parametrize("case", POLICY_CASES, ids=lambda c: c.name)
def test_case_declared_properties(case: PolicyCase):
    policy = get_policy(case.name, **case.knobs)
    assert set(case.knobs) <= set(type(policy).knobs())
    assert policy.stochastic == case.stochastic
    assert policy.needs == case.needs
    assert policy.query_rows == case.query_rows
    assert policy.window(16) == (16 if case.query_rows is None else case.query_rows)


@pytest.mark.parametrize("case", POLICY_CASES, ids=lambda c: c.name)
def test_case_hand_checked_selection(case: PolicyCase):
    policy = get_policy(case.name, sink_blocks=HAND_SINKS, recent_blocks=HAND_RECENT,
                        carry=0, **case.knobs)
    if case.head_only:  # no block score: refused by the policy and by the config
        with pytest.raises(ValueError, match="granularity 'head'"):
            policy.select(HAND_EVIDENCE, HAND_BUDGET, state={})
        with pytest.raises(ConfigError, match="granularity 'head'") as err:
            EvictionConfig.from_dict({"method": case.name, "max_tokens": 1024})
        assert err.value.field == "method"
        return
    keeps = {tuple(policy.select(HAND_EVIDENCE, HAND_BUDGET, state={},
                                 generator=torch.Generator().manual_seed(seed)).tolist())
             for seed in range(8)}
    if case.keep is not None:
        assert keeps == {case.keep}
    else:  # stochastic: the seed matters, the forced set and the budget do not move
        assert len(keeps) > 1
        assert all(len(k) == HAND_BUDGET and set(HAND_FORCED) <= set(k) for k in keeps)


@pytest.mark.parametrize("case", POLICY_CASES, ids=lambda c: c.name)
def test_case_knobs_through_the_config(case: PolicyCase):
    """Top-level knobs land in policy_args, build the same policy, and round-trip."""
    granularity = {"granularity": "head"} if case.head_only else {}
    cfg = EvictionConfig.from_dict({"method": case.name, "max_tokens": 1024, **granularity,
                                    **case.knobs})
    assert cfg.policy_args == dict(case.knobs)
    assert cfg.event_policies().decode == get_policy(case.name, sink_blocks=cfg.sink_blocks,
                                      recent_blocks=cfg.recent_blocks, carry=cfg.carry,
                                      **case.knobs)
    assert EvictionConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    if case.bad_knob is not None:  # refused when the config is built, naming the knob
        knob, value = case.bad_knob
        # A top-level key is named as written; a knob inside policy_args/prefill_args
        # by its qualified name.
        for given, field in (({knob: value}, knob),
                             ({f"prefill_{knob}": value}, f"prefill_{knob}"),
                             ({"policy_args": {knob: value}}, f"policy_args.{knob}"),
                             ({"prefill_args": {knob: value}}, f"prefill_args.{knob}")):
            with pytest.raises(ConfigError) as err:
                EvictionConfig.from_dict({"method": case.name, **given})
            assert err.value.field == field and str(err.value).startswith(field)


@pytest.mark.parametrize("case", POLICY_CASES, ids=lambda c: c.name)
def test_case_refuses_evidence_it_needs(case: PolicyCase):
    if case.head_only:
        pytest.skip("no block score (its head evidence: tests/core/test_head_paged.py)")
    policy = get_policy(case.name, sink_blocks=HAND_SINKS, recent_blocks=HAND_RECENT,
                        carry=0, **case.knobs)
    mass_only = Evidence(HAND_EVIDENCE.mass)
    missing = sorted(case.needs - {"mass"})
    if missing:
        with pytest.raises(ValueError, match=re.escape(f"needs {missing}")):
            policy.select(mass_only, HAND_BUDGET)
    else:
        assert policy.select(mass_only, HAND_BUDGET).numel() == HAND_BUDGET


BLOCK_CASES = [case for case in POLICY_CASES if not case.head_only]


@settings(max_examples=40, deadline=None)
@given(
    case=st.sampled_from(BLOCK_CASES),
    w=st.integers(1, 16),
    n=st.integers(1, 64),
    sinks=st.integers(1, 4),
    recent=st.integers(0, 4),
    extra=st.integers(0, 30),
    seed=st.integers(0, 10_000),
)
def test_policy_invariants(case, w, n, sinks, recent, extra, seed):
    budget = sinks + recent + 1 + extra
    mass = random_mass(w, n, seed)
    knobs = {**case.knobs, "sink_blocks": sinks, "recent_blocks": recent}
    keep = run_select(case.name, mass, budget, seed, **knobs)
    assert keep.dtype == torch.long
    assert keep.numel() == min(n, budget)  # exact budget
    assert torch.equal(keep, torch.unique(keep))  # sorted, unique
    assert int(keep.min()) >= 0 and int(keep.max()) < n
    assert set(forced_blocks(n, sinks, recent).tolist()) <= set(keep.tolist())
    again = run_select(case.name, mass, budget, seed, **knobs)
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
        get_policy("snapkv", sink_blocks=2, recent_blocks=4).select(
            Evidence(random_mass(4, 30, 0)), 5)


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
    assert indirect_scores(mass, indirect="walk")[bridge] > 0


def test_direct_max_keeps_what_one_row_reads_closely():
    # Block 1 is what one question row reads (one fact of several asked for); block 0 is
    # read lightly by every row.
    mass = torch.tensor([[0.30, 0.60, 0.10, 0.00],
                         [0.30, 0.00, 0.00, 0.70],
                         [0.30, 0.00, 0.70, 0.00],
                         [0.30, 0.00, 0.00, 0.70]])
    mean = direct_scores(mass)
    best = direct_scores(mass, "max")
    assert mean[0] > mean[1]  # the mean dilutes the one row that reads block 1
    assert best[1] > best[0] and int(best.argmin()) == 0
    assert float(best.sum()) == pytest.approx(1.0)  # on the mean's scale for the walk's sum
    assert torch.equal(direct_scores(torch.zeros(3, 4), "max"), torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ConfigError, match="direct"):
        direct_scores(mass, "median")


def test_best_row_reads_the_shares_softmax_gave():
    # Rows of maxima over heads and layers: row 0's heads disagree (its maxima sum to 2),
    # one of them reads block 1 at 0.8; row 1's heads agree on block 2 at 0.5.
    maxima = torch.tensor([[0.4, 0.8, 0.2, 0.6],
                           [0.25, 0.0, 0.5, 0.25]])
    evidence = Evidence.from_gathered({"mass": maxima}, attention_reduce="max")
    torch.testing.assert_close(evidence.mass.sum(1), torch.ones(2))
    torch.testing.assert_close(evidence.row_scale, torch.tensor([2.0, 1.0]))
    raw = direct_scores(evidence.mass, "max", evidence.row_scale)
    renormalised = direct_scores(evidence.mass, "max")  # no scale: the renormalised rows
    assert int(raw.argmax()) == 1 and int(renormalised.argmax()) == 2
    torch.testing.assert_close(raw, direct_scores(maxima, "max"))
    # Nexus reads the scale through its evidence; under a mean there is none to read.
    nexus = get_policy("nexus", direct="max", indirect="none", sampler="topk",
                       sink_blocks=1, recent_blocks=0)
    assert nexus.select(evidence, 3).tolist() == [0, 1, 3]
    assert Evidence.from_gathered({"mass": evidence.mass}, attention_reduce="mean").row_scale is None
    with pytest.raises(ValueError, match="row_scale"):
        Evidence(evidence.mass, row_scale=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="row_scale"):
        Evidence(evidence.mass, row_scale=torch.tensor([1.0, -1.0]))


def test_prompt_end_event_reads_each_blocks_best_row():
    cfg = EvictionConfig(method="nexus", max_tokens=1024)
    policies = cfg.event_policies()
    assert (policies.decode.direct, policies.prefill.direct) == ("mean", "max")
    assert cfg.replace(prompt_mode="stream").event_policies().prefill.direct == "mean"
    assert cfg.replace(prefill_args={"direct": "mean"}).event_policies().prefill.direct == "mean"
    with pytest.raises(ConfigError, match="direct"):
        get_policy("nexus", direct="rows")


def test_nexus_weights_modes_and_ramp():
    mass = random_mass(8, 10, 3)
    for mode in ("walk", "none"):
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
    policy.select(Evidence(first), 6, state=state)
    second = torch.zeros(1, 8)
    second[0, 3] = 0.6  # ...block 3 is heavier now, but not in total
    second[0, 4] = 0.4
    keep = policy.select(Evidence(second), 3, state=state)
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
            keep = policy.select(Evidence(event_mass(dip)), budget, generator=generator)
            if target not in keep.tolist():
                return False
        return True

    topk = get_policy("nexus", sampler="topk", lam=0.0, sink_blocks=1, recent_blocks=1,
                      carry=0)
    assert not survives(topk, None)
    pps = get_policy("nexus", sampler="pps", lam=0.0, sink_blocks=1, recent_blocks=1,
                     carry=0)
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
        (lambda: get_policy("knorm").select(Evidence(random_mass(2, 20, 0)), 8), "key_norms"),
        (lambda: Evidence(torch.full((2, 3), float("nan"))), "finite"),
        (lambda: Evidence(torch.ones(2, 3)), "rows must sum to 1"),
        (lambda: Evidence(random_mass(2, 3, 0), torch.ones(4)), "key_norms must be 3"),
        (lambda: Evidence(random_mass(2, 3, 0), torch.tensor([1.0, float("inf"), 1.0])),
         "key_norms must be 3 finite"),
    ],
)
def test_bad_policy_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_eviction_config():
    cfg = EvictionConfig(method="nexus", max_tokens=1024, block_size=32)
    assert budget_blocks(cfg, 100_000) == 32
    ratio = EvictionConfig(keep_ratio=0.2)
    assert budget_blocks(ratio, 64) == ratio.num_forced  # never below the forced set
    assert budget_blocks(ratio, 32 * 100) == 20
    # The defaults: prompt mode end (direct attention and top-K at the prompt-end event,
    # the walk at decode), heads and layers by their maximum, one block of carry.
    assert (ratio.prompt_mode, ratio.attention_reduce, ratio.carry) == ("end", "max", 1)
    policies = ratio.event_policies()
    assert policies.prefill.indirect == "none" and policies.decode.indirect == "walk"
    streaming = ratio.replace(prompt_mode="stream")
    assert streaming.event_policies().prefill.indirect == "walk"
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
        ({"sampler": "x"}, "^sampler must be one of"),
        ({"n": 0}, "^n must be"),
        ({"eps": -1.0}, "^eps must be >= 0"),
        ({"prefill_indirect": "hub"}, "^prefill_indirect='hub' was removed"),
        ({"indirect": "hub"}, "^indirect='hub' was removed"),
        ({"indirect": "ppr"}, "^indirect='ppr' was removed"),
        ({"prefill_indirect": "walks"}, "^prefill_indirect must be one of"),
        ({"policy_args": {"steps": 0}}, "policy_args.steps must be >= 1"),
        ({"prefill_args": {"lamda": 1}}, "prefill_args.lamda: not a knob of policy 'nexus' "
                                         "\\(did you mean 'lam'\\?\\)"),
        ({"method": "h2o", "steps": 5}, "steps: a knob of policy 'nexus', not of method 'h2o'"),
        ({"method": "snapkv", "prefill_sampler": "topk"}, "a knob of policy 'nexus'"),
        ({"method": "tova", "policy_args": {"lam": 1}}, "policy_args.lam: a knob of policy"),
        ({"method": "none", "policy_args": {"lam": 1}}, "method 'none' runs no policy"),
        ({"policy_args": ["steps"]}, "policy_args must be a mapping"),
        ({"carry": -1}, "^carry must be >= 0"),
        ({"carry": 5}, "^carry must be <= 4"),
        ({"attention_reduce": "sum"}, "^attention_reduce must be one of"),
    ],
)
def test_bad_eviction_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EvictionConfig.from_dict(kwargs)


def test_knobs_live_with_the_policy():
    """Top-level knobs (as the presets write them) and prefill_<knob> keys land in
    policy_args / prefill_args; prefill events take the policy's declared defaults for
    the prompt mode unless prefill_args says otherwise; eps is reachable."""
    cfg = EvictionConfig.from_dict({"method": "nexus", "steps": 5, "eps": 0.0,
                                    "prefill_indirect": "none", "prefill_sampler": None})
    assert cfg.policy_args == {"steps": 5, "eps": 0.0}
    assert cfg.prefill_args == {"indirect": "none"}  # None: the policy's prefill default
    policies = cfg.event_policies()
    assert (policies.decode.eps, policies.decode.indirect, policies.prefill.indirect) \
        == (0.0, "walk", "none")
    assert cfg.event_policies().prefill.steps == 5  # a knob not overridden stays the decode one
    # The declared defaults: walk (and the decode sampler) after a prompt chunk; none and
    # top-K at the prompt-end event.
    ares = EvictionConfig.from_dict({"sampler": "ares", "indirect": "none",
                                     "prompt_mode": "stream"})
    assert (ares.event_policies().prefill.indirect, ares.event_policies().prefill.sampler) \
        == ("walk", "ares")
    end = ares.replace(prompt_mode="end")
    assert (end.event_policies().prefill.indirect, end.event_policies().prefill.sampler) \
        == ("none", "topk")
    assert end.event_policies().decode.sampler == "ares"  # decode events: the same in every mode
    assert end.replace(prefill_sampler="pps").event_policies().prefill.sampler == "pps"
    # Explicit mappings and top-level keys merge (top level wins); replace re-lifts them.
    both = EvictionConfig.from_dict({"policy_args": {"steps": 2, "lam": 1.0}, "steps": 4})
    assert both.policy_args == {"steps": 4, "lam": 1.0}
    assert both.replace(lam=0.0).policy_args == {"steps": 4, "lam": 0.0}
    # A new method starts from its own defaults: the old policy's knobs mean nothing to it.
    assert both.replace(method="h2o").policy_args == {}
    assert both.replace(method="nexus").policy_args == both.policy_args
    # Method none runs no policy: the knobs a preset was written with are moot.
    assert EvictionConfig.from_dict({"method": "none", "steps": 5}).policy_args == {}
    # The config travels as JSON and comes back equal; its mappings are its own copies.
    given = {"steps": 3}
    cfg = EvictionConfig(policy_args=given)
    given["steps"] = 9
    assert cfg.policy_args == {"steps": 3}
    assert EvictionConfig.from_dict(json.loads(json.dumps(end.to_dict()))) == end


def test_carry_forward_keeps_the_block_after_a_found_one():
    """A fact the window attends to in block j often ends in block j + 1: with ``carry``
    that block's weight is raised to block j's, so top-K keeps both."""
    from nexus_vllm.core import carry_forward

    w = torch.tensor([0.1, 0.9, 0.0, 0.2, 0.05])
    assert carry_forward(w, 0).tolist() == w.tolist()
    assert carry_forward(w, 1).tolist() == pytest.approx([0.1, 0.9, 0.9, 0.2, 0.2])
    assert carry_forward(w, 2).tolist() == pytest.approx([0.1, 0.9, 0.9, 0.9, 0.2])
    assert carry_forward(torch.tensor([0.5]), 3).tolist() == [0.5]
    # 12 blocks: sink 0, needle key in block 5 (its value spills into block 6), forced
    # recents and current 7..11; budget 8 leaves 2 choices. Without carry the runner-up
    # (block 2) takes the second slot; with carry block 6 does.
    mass = torch.full((1, 12), 0.01)
    mass[0, 5], mass[0, 2] = 0.6, 0.2
    mass = mass / mass.sum()
    plain = get_policy("snapkv", recent_blocks=4, carry=0).select(Evidence(mass), 8)
    carried = get_policy("snapkv", recent_blocks=4, carry=1).select(Evidence(mass), 8)
    assert 5 in plain and 6 not in plain and 2 in plain
    assert {5, 6} <= set(carried.tolist()) and 2 not in carried
    # Policies that read no mass ignore it (their scores are not attention).
    norms = torch.linspace(1.0, 2.0, 12)
    assert torch.equal(get_policy("knorm", carry=1).select(Evidence(key_norms=norms), 8),
                       get_policy("knorm", carry=0).select(Evidence(key_norms=norms), 8))
    # The config carries it to every policy it builds.
    cfg = EvictionConfig(method="tova", carry=1, attention_reduce="max")
    assert cfg.event_policies().decode.carry == 1 and cfg.event_policies().prefill.carry == 1


def test_eviction_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown eviction config key"):
        EvictionConfig.from_dict({"method": "nexus", "budget": 3})
    with pytest.raises(ValueError, match="unknown eviction config key"):
        EvictionConfig().replace(budget=3)


@pytest.mark.parametrize("sinks, recent", [(1, 0), (1, 2), (3, 4)])
def test_the_forced_set_formula_is_one(sinks: int, recent: int) -> None:
    """``forced_count`` (what budget floors and checks read) is the size of the set
    ``forced_blocks`` forces once a sequence is long enough; ``forced_tail`` its newest
    part (what the scheduler keeps out of an event's evictable range)."""
    from nexus_vllm.core import EvictionConfig, forced_blocks, forced_count, forced_tail

    n = 40
    forced = forced_blocks(n, sinks, recent).tolist()
    assert len(forced) == forced_count(sinks, recent)
    assert forced[-forced_tail(recent):] == list(range(n - forced_tail(recent), n))
    cfg = EvictionConfig(method="nexus", max_tokens=1024, sink_blocks=sinks,
                         recent_blocks=recent)
    assert cfg.num_forced == cfg.event_policies().decode.num_forced == forced_count(sinks, recent)


# -- renamed config keys -------------------------------------------------------------
def test_former_key_names_are_accepted_with_a_deprecation_line(caplog):
    from nexus_vllm.core import config as config_module

    config_module._warned_renamed.clear()
    with caplog.at_level("WARNING", logger="nexus_vllm.core.config"):
        old = EvictionConfig.from_dict({"method": "nexus", "max_tokens": 512,
                                        "head_reduce": "mean", "prefill_window": 8})
    new = EvictionConfig.from_dict({"method": "nexus", "max_tokens": 512,
                                    "attention_reduce": "mean", "prompt_window": 8})
    assert old == new and (old.attention_reduce, old.prompt_window) == ("mean", 8)
    said = caplog.text
    assert "'head_reduce' is now 'attention_reduce'" in said
    assert "'prefill_window' is now 'prompt_window'" in said
    # Through replace() and from_budget(), the paths eval method specs and presets take.
    assert new.replace(head_reduce="max").attention_reduce == "max"
    assert EvictionConfig.from_budget("nexus", 0.2, prefill_window=4).prompt_window == 4


def test_a_later_key_wins_whichever_name_it_uses():
    later_old = EvictionConfig.from_dict({"max_tokens": 512, "attention_reduce": "max",
                                          "head_reduce": "mean"})
    later_new = EvictionConfig.from_dict({"max_tokens": 512, "head_reduce": "mean",
                                          "attention_reduce": "max"})
    assert (later_old.attention_reduce, later_new.attention_reduce) == ("mean", "max")


def test_a_policy_built_by_name_is_the_one_the_server_runs():
    """One set of shared defaults (SHARED_KNOBS, the config's): get_policy(name) is the
    decode policy of a config of that method with every default."""
    from nexus_vllm.core.evidence import carried_kinds
    from nexus_vllm.core.policies import POLICIES, SHARED_KNOBS

    cfg = EvictionConfig()
    assert {k: getattr(cfg, k) for k in SHARED_KNOBS} == dict(SHARED_KNOBS)
    for name, cls in POLICIES.items():
        granularity = "head" if cls.head_only else "block"
        served = EvictionConfig(method=name, max_tokens=1024, granularity=granularity)
        assert get_policy(name) == served.event_policies().decode, name
    # Carry is a fact about evidence kinds: attention carries, a block's key norm not.
    assert carried_kinds() == {"mass", "expected_attention"}
