"""Head-paged selection and per-head evidence (nexus_vllm.core.head_paged) against brute
force references, seeded."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nexus_vllm.core import EvictionConfig
from nexus_vllm.core._validate import ConfigError
from nexus_vllm.core.evidence.expected_attention import expected_attention
from nexus_vllm.core.head_paged import (
    PROFILES_DIR,
    HeadEvidence,
    apportion_head_blocks,
    forced_positions,
    head_blocks_held,
    head_expected_attention,
    head_key_norms,
    head_window_attention,
    load_head_profile,
    select_head_units,
)
from nexus_vllm.core.policies import POLICIES, standardized_head_norms
from nexus_vllm.core.rotary import Rotary

# (layers, kv heads, tokens, block size)
SHAPES = [(1, 1, 40, 8), (3, 2, 97, 8), (4, 3, 130, 16)]
SAMPLERS = ["topk", "pps", "ares"]
GROUPS = [1, 4]
# (query heads, kv heads, window, tokens, head dim)
ATTENTION_SHAPES = [(4, 2, 5, 33, 8), (6, 3, 16, 64, 16), (2, 2, 1, 9, 4)]


def _case(shape: tuple[int, int, int, int], seed: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    layers, heads, t, bs = shape
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(layers, heads, t, generator=g)
    live = torch.rand(layers, heads, t, generator=g) > 0.2
    positions = torch.arange(t) * 2  # every other position evicted in all heads before
    forced = forced_positions(positions, int(positions[-1]) + 1, bs, 1, 1)
    live |= forced.view(1, 1, t)
    return scores, live, forced, positions


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("group", GROUPS)
def test_selection_keeps_the_forced_set_within_the_head_block_budget(
        shape: tuple[int, int, int, int], sampler: str, group: int) -> None:
    layers, heads, t, bs = shape
    for seed in range(4):
        scores, live, forced, positions = _case(shape, seed)
        floor = head_blocks_held(live & forced.view(1, 1, t), bs)
        held = head_blocks_held(live, bs)
        # Every budget from the forced floor to what is held: every residue of the rounding.
        for budget in range(floor, held + 2, max(1, (held - floor) // 7)):
            keep = select_head_units(scores, live, forced, budget, bs, positions=positions,
                                     group=group, sampler=sampler,
                                     generator=torch.Generator().manual_seed(seed))
            assert not bool((keep & ~live).any()), "kept an entry no head held"
            assert bool(keep[live & forced.view(1, 1, t)].all()), "dropped a forced entry"
            assert head_blocks_held(keep, bs) <= budget
            if budget >= held:
                assert torch.equal(keep, live)


def test_selection_below_the_forced_floor_is_refused() -> None:
    scores, live, forced, positions = _case(SHAPES[1], 0)
    floor = head_blocks_held(live & forced.view(1, 1, -1), 8)
    with pytest.raises(ValueError, match="forced entries need"):
        select_head_units(scores, live, forced, floor - 1, 8, positions=positions)


def test_one_threshold_spends_the_budget_where_the_scores_are() -> None:
    layers, heads, t, bs = 2, 2, 64, 8
    scores = torch.zeros(layers, heads, t)
    scores[1, 0] = 1.0  # one head whose every entry scores above all others
    live = torch.ones(layers, heads, t, dtype=torch.bool)
    forced = forced_positions(torch.arange(t), t, bs, 1, 0)  # 8 sinks, the last 8
    budget = 2 * 4 + 6  # the forced 2 blocks per head, and 6 more head-blocks
    keep = select_head_units(scores, live, forced, budget, bs)
    counts = keep.sum(dim=-1)
    assert int(counts[1, 0]) == 64  # all 8 of its blocks
    assert int(counts.sum()) - 64 == 3 * 16  # the others keep only what is forced


def test_topk_keeps_each_heads_best_entries() -> None:
    scores, live, forced, positions = _case(SHAPES[1], 3)
    keep = select_head_units(scores, live, forced, 20, 8, positions=positions)
    optional = live & ~forced.view(1, 1, -1)
    for li in range(keep.shape[0]):
        for h in range(keep.shape[1]):
            kept = scores[li, h][keep[li, h] & optional[li, h]]
            dropped = scores[li, h][~keep[li, h] & optional[li, h]]
            if kept.numel() and dropped.numel():
                assert float(kept.min()) >= float(dropped.max())


def test_groups_rise_and_fall_as_one_unit_away_from_the_rounding() -> None:
    layers, heads, t, bs, group = 1, 1, 64, 8, 8
    scores = torch.rand(layers, heads, t, generator=torch.Generator().manual_seed(1))
    scores[0, 0, 24] = 5.0  # one token lifts its whole group of 8 (positions 24..31)
    live = torch.ones(layers, heads, t, dtype=torch.bool)
    forced = forced_positions(torch.arange(t), t, bs, 1, 0)
    keep = select_head_units(scores, live, forced, 3, bs, group=group)
    assert bool(keep[0, 0, 24:32].all())
    assert int(keep.sum()) == 24


def test_pps_draws_depend_on_the_seed_and_favour_high_scores() -> None:
    layers, heads, t, bs = 2, 2, 256, 8
    scores = torch.full((layers, heads, t), 0.01)
    scores[0, 0] = 1.0
    live = torch.ones(layers, heads, t, dtype=torch.bool)
    forced = forced_positions(torch.arange(t), t, bs, 1, 0)
    draws = [select_head_units(scores, live, forced, 40, bs, sampler="pps",
                               generator=torch.Generator().manual_seed(s)) for s in range(6)]
    assert any(not torch.equal(draws[0], d) for d in draws[1:])
    for keep in draws:
        counts = keep.sum(dim=-1)
        assert int(counts[0, 0]) > int(counts[1, 1])


def _window_reference(q: torch.Tensor, k: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Per query head, per row: softmax over the live keys it may see, then the largest
    weight per KV head's entry (a plain loop)."""
    w, hq, d = q.shape
    t, hkv, _ = k.shape
    out = torch.zeros(hkv, t)
    for j in range(hq):
        h = j // (hq // hkv)
        for r in range(w):
            visible = live[h].clone()
            visible[t - w + r + 1:] = False
            logits = (k[:, h] @ q[r, j]) / math.sqrt(d)
            probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=0)
            out[h] = torch.maximum(out[h], probs)
    return out


@pytest.mark.parametrize("hq, hkv, w, t, d", ATTENTION_SHAPES)
def test_head_window_attention_matches_a_loop(hq: int, hkv: int, w: int, t: int,
                                              d: int) -> None:
    g = torch.Generator().manual_seed(hq * 100 + t)
    q = torch.randn(w, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    live = torch.rand(hkv, t, generator=g) > 0.3
    live[:, -w:] = True  # the window's own tokens are live
    got = head_window_attention(q, k, live)
    torch.testing.assert_close(got, _window_reference(q, k, live), rtol=1e-5, atol=1e-6)
    assert bool((got[~live] == 0).all())


def test_head_expected_attention_reduces_to_the_block_kind() -> None:
    """With every entry live and one query head per KV head, summing each head's shares
    over a block and taking the largest over heads is the block kind under ``max``."""
    g = torch.Generator().manual_seed(7)
    h, w, t, d, bs = 3, 6, 40, 8, 8
    q = torch.randn(w, h, d, generator=g)
    k = torch.randn(t, h, d, generator=g)
    positions = torch.arange(t - w, t)
    rotary = Rotary.from_inv_freq(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 256,
                                  head_size=d)
    live = torch.ones(h, t, dtype=torch.bool)
    per_head = head_expected_attention(q, positions, k, live, t, rotary)
    torch.testing.assert_close(per_head.sum(dim=-1), torch.ones(h))
    blocks = per_head.view(h, -1, bs).sum(dim=-1).amax(dim=0)
    torch.testing.assert_close(
        blocks, expected_attention(q, positions, k, t, rotary, bs, attention_reduce="max"))


def test_key_norms_and_their_per_head_standardisation() -> None:
    k = torch.randn(20, 2, 4, generator=torch.Generator().manual_seed(2))
    norms = head_key_norms(k)
    torch.testing.assert_close(norms, k.norm(dim=-1).T)
    live = torch.ones(1, 2, 20, dtype=torch.bool)
    live[0, 1, :5] = False
    z = standardized_head_norms(norms[None], live)
    assert bool((z[~live] == 0).all())
    for h in range(2):
        assert abs(float(z[0, h][live[0, h]].mean())) < 1e-5


def test_every_policy_with_a_head_score_returns_one_weight_per_entry() -> None:
    live = torch.ones(2, 2, 12, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    kinds = {k: torch.rand(2, 2, 12, generator=g) for k in
             ("mass", "expected_attention", "key_norms", "reconstruction")}
    evidence = HeadEvidence(live=live, kinds=kinds)
    with_score = [m for m in POLICIES if POLICIES[m]().head_needs]
    assert {"nexus", "knorm", "expected", "snapkv", "tova"} <= set(with_score)
    for method in with_score:
        policy = POLICIES[method]()
        assert policy.head_needs <= set(kinds)
        assert policy.head_score(evidence).shape == (2, 2, 12)
    assert torch.equal(POLICIES["knorm"]().head_score(evidence), -kinds["key_norms"])
    assert torch.equal(POLICIES["reconstruction"]().head_score(evidence),
                       kinds["reconstruction"])
    with pytest.raises(ValueError, match="has no per-head score"):
        POLICIES["h2o"]().head_score(evidence)


def test_config_granularity_is_validated_naming_the_field() -> None:
    cfg = EvictionConfig.from_dict({"method": "nexus", "max_tokens": 416,
                                    "granularity": "head", "head_group": 16})
    assert (cfg.granularity, cfg.head_group) == ("head", 16)
    assert EvictionConfig().granularity == "block"
    with pytest.raises(ConfigError, match="granularity must be one of") as bad:
        EvictionConfig(granularity="heads")
    assert bad.value.field == "granularity"
    with pytest.raises(ConfigError, match="'h2o' has none") as none:
        EvictionConfig(method="h2o", granularity="head")
    assert none.value.field == "granularity"
    with pytest.raises(ConfigError, match="head_group must be a positive divisor"):
        EvictionConfig(head_group=5)


@pytest.mark.parametrize("budget", [6, 9, 17, 40, 200])
def test_apportioned_head_blocks_follow_the_shares_within_their_bounds(budget: int) -> None:
    shares = torch.tensor([[0.5, 0.1], [0.3, 0.1]])
    floor = torch.full((2, 2), 1, dtype=torch.long)
    held = torch.tensor([[30, 30], [5, 30]])
    blocks = apportion_head_blocks(shares, budget, floor, held)
    assert bool((blocks >= floor).all()) and bool((blocks <= held).all())
    assert int(blocks.sum()) == min(budget, int(held.sum()))
    if budget == 40:  # head (1, 0) is full at 5: the others share what it cannot take
        assert int(blocks[1, 0]) == 5
        assert int(blocks[0, 0]) > int(blocks[0, 1]) == int(blocks[1, 1])


def test_selection_with_a_profile_keeps_each_heads_best_in_its_share() -> None:
    scores, live, forced, positions = _case(SHAPES[2], 5)
    layers, heads, t, bs = SHAPES[2]
    shares = torch.rand(layers, heads, generator=torch.Generator().manual_seed(9))
    floor = head_blocks_held(live & forced.view(1, 1, t), bs)
    for budget in (floor, floor + 3, floor + 11):
        keep = select_head_units(scores, live, forced, budget, bs, positions=positions,
                                 shares=shares)
        assert head_blocks_held(keep, bs) <= budget
        assert bool(keep[live & forced.view(1, 1, t)].all())
        optional = live & ~forced.view(1, 1, t)
        for li in range(layers):
            for h in range(heads):
                kept = scores[li, h][keep[li, h] & optional[li, h]]
                dropped = scores[li, h][~keep[li, h] & optional[li, h]]
                if kept.numel() and dropped.numel():
                    assert float(kept.min()) >= float(dropped.max())


def test_head_profiles_load_by_name_or_path_and_bad_ones_name_the_field(tmp_path) -> None:
    good = tmp_path / "p.json"
    good.write_text(json.dumps({"model": "m", "budget_share": 0.2,
                                "shares": [[0.25, 0.25], [0.5, 0.0]]}))
    profile = load_head_profile(str(good))
    assert profile.tensor().shape == (2, 2)
    cfg = EvictionConfig(granularity="head", head_profile=str(good))
    assert cfg.head_profile == str(good)
    for name in sorted(p.stem for p in PROFILES_DIR.glob("*.json")):
        assert load_head_profile(name).tensor().sum() > 0
    with pytest.raises(ConfigError, match="neither a file nor a shipped profile") as missing:
        EvictionConfig(granularity="head", head_profile="no-such-model")
    assert missing.value.field == "head_profile"
    with pytest.raises(ConfigError, match="needs granularity 'head'"):
        EvictionConfig(head_profile=str(good))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "m", "budget_share": 0.2, "shares": [[-1.0]]}))
    with pytest.raises(ConfigError, match="non-negative"):
        load_head_profile(str(bad))
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="not a head profile"):
        load_head_profile(str(bad))
