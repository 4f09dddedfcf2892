"""Expected attention (``core/evidence/expected_attention.py``): its reference against an
explicit evaluation of its formula (D x D covariances, the mean of transformers' rotation
matrices over the horizon), and what it is for: keys along the future queries' direction.
The paged gatherer is checked with every kind in ``test_evidence.py``."""

from __future__ import annotations

import math

import pytest
import torch

from nexus_vllm.core import Evidence, evidence_kind
from nexus_vllm.core.evidence.expected_attention import HORIZON, expected_attention
from tests.core.test_evidence import HEAD_SHAPES, _rope, _rotary


def _explicit_expected_attention(queries, positions, keys, next_position, head_size, block_size):
    """The formula of the module docstring, term by term: D x D covariances and the
    explicit mean of the rotation matrices over the horizon."""
    rotary = _rotary(head_size)
    pre = rotary.unrotate(queries, positions).double()  # [W, Hq, D]
    eye = torch.eye(head_size).view(head_size, 1, head_size)
    mats = torch.stack([_rope(eye, torch.full((head_size,), p), head_size)[:, 0, :].T
                        for p in range(next_position, next_position + HORIZON)]).double()
    a = mats.mean(0)
    t, hkv, d = keys.shape
    hq = queries.shape[1]
    k = keys.double().repeat_interleave(hq // hkv, dim=1)  # [T, Hq, D]
    per_head = []
    for h in range(hq):
        mu = pre[:, h].mean(0)
        centred = pre[:, h] - mu
        sigma = centred.T @ centred / pre.shape[0]
        mu2, sigma2 = a @ mu, a @ sigma @ a.T
        logits = k[:, h] @ mu2 / math.sqrt(d) + torch.einsum(
            "td,de,te->t", k[:, h], sigma2, k[:, h]) / (2 * d)
        probs = torch.softmax(logits, 0)
        n = -(-t // block_size)
        per_head.append(torch.nn.functional.pad(probs, (0, n * block_size - t))
                        .view(n, block_size).sum(-1))
    return torch.stack(per_head).mean(0).float()


@pytest.mark.parametrize("shape", HEAD_SHAPES[:2])
def test_expected_attention_matches_its_formula(shape):
    hq, hkv, d, bs = shape
    g = torch.Generator().manual_seed(2)
    t, w = 45, 6
    positions = torch.arange(t - w, t)
    queries = _rope(torch.randn(w, hq, d, generator=g), positions, d)
    keys = _rope(torch.randn(t, hkv, d, generator=g), torch.arange(t), d)
    got = expected_attention(queries, positions, keys, t, _rotary(d), bs)
    want = _explicit_expected_attention(queries, positions, keys, t, d, bs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
    assert abs(float(got.sum()) - 1.0) < 1e-4


def test_expected_attention_follows_the_query_direction():
    """Keys along the mean pre-RoPE query get the expected attention; the window's own
    attention need not (its rows sit at other positions)."""
    d, bs = 16, 4
    rotary = _rotary(d)
    g = torch.Generator().manual_seed(3)
    direction = torch.randn(d, generator=g)
    t, w = 64, 8
    positions = torch.arange(t - w, t)
    pre_q = direction + 0.05 * torch.randn(w, 1, d, generator=g)
    queries = _rope(pre_q, positions, d)
    pre_k = 0.1 * torch.randn(t, 1, d, generator=g)
    pre_k[20:24, 0] = 3 * direction  # block 5 holds keys along the queries
    keys = _rope(pre_k, torch.arange(t), d)
    scores = expected_attention(queries, positions, keys, t, rotary, bs)
    assert int(scores.argmax()) == 5


def test_expected_attention_is_a_registered_kind():
    kind = evidence_kind("expected_attention")
    assert kind.layout == "blocks" and kind.needs_rotary and kind.reads_queries
    mass = torch.full((2, 5), 0.2)
    ev = Evidence(mass, expected_attention=torch.full((5,), 0.2))
    assert ev.holds == {"mass", "expected_attention"}
    with pytest.raises(ValueError, match="expected_attention must be 5 finite values"):
        Evidence(mass, expected_attention=torch.ones(4))
    # Gathered maxima renormalised to a distribution over the blocks.
    ev = Evidence.from_gathered({"expected_attention": torch.tensor([1.0, 2.0, 1.0])},
                                attention_reduce="max")
    torch.testing.assert_close(ev["expected_attention"], torch.tensor([0.25, 0.5, 0.25]))


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "half"])
def test_a_bad_mix_is_refused_naming_the_knob(value):
    from nexus_vllm.core import ConfigError, EvictionConfig

    for given, field in (({"policy_args": {"expected": value}}, "policy_args.expected"),
                         ({"expected": value}, "expected")):
        with pytest.raises(ConfigError) as err:
            EvictionConfig.from_dict({"method": "nexus", "max_tokens": 1024, **given})
        assert err.value.field.endswith(field) and "expected" in str(err.value)


def test_the_mix_reads_expected_attention_and_keeps_rows_distributions():
    from nexus_vllm.core import get_policy

    mass = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])
    expected = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])
    ev = Evidence(mass, expected_attention=expected)
    half = get_policy("nexus", expected=0.5)
    assert half.needs == {"mass", "expected_attention"}
    mixed = half.combined_mass(ev)
    torch.testing.assert_close(mixed.sum(-1), torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(mixed[:, 2], torch.tensor([0.55, 0.6], dtype=torch.float64))
    only = get_policy("nexus", expected=1.0, recent_blocks=0, sampler="topk")
    assert only.needs == {"expected_attention"}
    keep = only.select(Evidence(expected_attention=expected), 3)
    assert keep.tolist() == [0, 2, 4]  # sink, the expected block, the current block


def test_stream_defaults_apply_in_stream_only_and_a_config_overrides_them():
    from nexus_vllm.core import EvictionConfig

    stream = EvictionConfig(method="nexus", max_tokens=1024, prompt_mode="stream")
    for prefill in (False, True):
        policy = stream.event_policies().at(prefill=prefill)
        assert (policy.expected, policy.knorm_prior) == (0.5, 4.0)
        assert policy.needs == {"mass", "expected_attention", "key_norms"}
    assert stream.event_policies().prefill.indirect == "walk"  # prefill defaults still apply
    assert stream.evidence_kinds() == {"mass", "expected_attention", "key_norms"}
    end = EvictionConfig(method="nexus", max_tokens=1024, prompt_mode="end")
    assert end.evidence_kinds() == {"mass"}
    policies = end.event_policies()
    assert (policies.decode.expected, policies.prefill.knorm_prior) == (0.0, 0.0)
    before = stream.replace(policy_args={"expected": 0, "knorm_prior": 0})
    assert before.event_policies().decode.needs == {"mass"} and before.evidence_kinds() == {"mass"}
    # Another policy's stream mode is untouched.
    assert EvictionConfig(method="snapkv", max_tokens=1024, prompt_mode="stream"
                          ).evidence_kinds() == {"mass"}


def test_the_key_norm_prior_mixed_in_keeps_what_either_evidence_ranks_high():
    """``knorm_share``: the prior added as a distribution of its own keeps the block the
    window's attention favours *and* the lowest-norm block, where the product lets the
    window's recency (old blocks draw almost no mass) override the prior."""
    from nexus_vllm.core import ConfigError, get_policy

    # Block 1 holds the window's attention; block 3 (old, no mass) the lowest key norm.
    mass = torch.tensor([[0.0, 0.9, 0.0, 1e-9, 0.1]]).double()
    norms = torch.tensor([5.0, 5.0, 5.0, 1.0, 5.0])
    ev = Evidence(mass, key_norms=norms)
    common = {"recent_blocks": 0, "carry": 0, "sampler": "topk", "indirect": "none",
              "eps": 0.0}
    product = get_policy("nexus", knorm_prior=4.0, **common)
    mixture = get_policy("nexus", knorm_prior=4.0, knorm_share=0.5, **common)
    # Forced: the sink (0) and the current block (4); one more by weight.
    assert sorted(product.select(ev, 3).tolist()) == [0, 1, 4]
    assert sorted(mixture.select(ev, 3).tolist()) == [0, 3, 4]
    assert sorted(mixture.select(ev, 4).tolist()) == [0, 1, 3, 4]
    torch.testing.assert_close(mixture.keep_weights(ev, None).sum(),
                               torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(ConfigError, match="knorm_prior > 0"):
        get_policy("nexus", knorm_share=0.5)
    with pytest.raises(ConfigError, match="knorm_share"):
        get_policy("nexus", knorm_prior=1.0, knorm_share=1.0)


def test_a_successor_inherits_attention_but_not_the_key_norm_prior():
    """``carry`` raises a block's weight to its predecessor's attention (a fact's value
    follows its key); the key-norm prior is each block's own and multiplies after it. A
    carried prior would spend a slot on the neighbour of every low-norm block: here block
    2 (after the lowest-norm block 1) would outrank block 4, the second-lowest norm."""
    from nexus_vllm.core import get_policy

    mass = torch.full((1, 8), 1.0 / 8, dtype=torch.float64)
    norms = torch.tensor([5.0, 1.0, 5.0, 5.0, 2.0, 5.0, 5.0, 5.0])
    ev = Evidence(mass, key_norms=norms)
    common = {"recent_blocks": 1, "sampler": "topk", "indirect": "none", "eps": 0.0}
    carried = get_policy("nexus", knorm_prior=4.0, carry=1, **common)
    plain = get_policy("nexus", knorm_prior=4.0, carry=0, **common)
    # Forced: the sink (0), the newest full block (6) and the current one (7).
    assert sorted(carried.select(ev, 5).tolist()) == [0, 1, 4, 6, 7]
    assert torch.equal(carried.select(ev, 5), plain.select(ev, 5))
    # Attention still carries under the prior: block 3 holds the window's attention.
    found = mass.clone()
    found[0, 3] = 0.5
    ev = Evidence(found / found.sum(), key_norms=torch.full((8,), 5.0))
    assert set(carried.select(ev, 5).tolist()) == {0, 3, 4, 6, 7}


@pytest.mark.parametrize("noise", [1e-7, 1e-6])
def test_constant_key_norms_give_a_flat_prior(noise: float) -> None:
    """Every key RMS-normalised to one length (Gemma 3's ``k_norm``): the prior must not
    read the norms' rounding noise, which differs from one TP layout to the next, as a
    ranking; the weights equal plain Nexus's to within the noise."""
    from nexus_vllm.core import get_policy

    gen = torch.Generator().manual_seed(0)
    mass = torch.rand(4, 12, generator=gen, dtype=torch.float64)
    mass = mass / mass.sum(dim=1, keepdim=True)
    sqrt_d = 32 ** 0.5
    norms = sqrt_d * (1 + noise * torch.randn(12, generator=gen, dtype=torch.float64))
    ev = Evidence(mass, key_norms=norms.float())
    plain = get_policy("nexus", sampler="topk").keep_weights(ev, None)
    prior = get_policy("nexus", sampler="topk", knorm_prior=4.0).keep_weights(ev, None)
    torch.testing.assert_close(prior, plain, rtol=2e-2, atol=0.0)


@pytest.mark.parametrize("noise", [1e-7, 1e-6])
def test_knorm_reads_constant_key_norms_as_a_tie(noise: float) -> None:
    """KNorm on keys of one length: two roundings of the same norms (two kernels, two TP
    layouts) keep the same blocks, the older ones, where the rounding used to choose."""
    from nexus_vllm.core import get_policy

    mass = torch.full((1, 12), 1.0 / 12, dtype=torch.float64)
    kept = []
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        norms = 32 ** 0.5 * (1 + noise * torch.randn(12, generator=gen, dtype=torch.float64))
        ev = Evidence(mass, key_norms=norms.float())
        kept.append(get_policy("knorm", recent_blocks=4).select(ev, 9).tolist())  # 6 forced
    assert kept[0] == kept[1] == [0, 1, 2, 3, 7, 8, 9, 10, 11]
    spread = Evidence(mass, key_norms=torch.tensor(
        [9.0, 5.0, 9.1, 4.0, 9.2, 6.0, 9.3, 4.5, 9.4, 5.5, 9.5, 9.6]))
    assert get_policy("knorm", recent_blocks=4).select(spread, 9).tolist() \
        == [0, 1, 3, 5, 7, 8, 9, 10, 11]


def test_a_real_spread_still_ranks() -> None:
    """A spread like SmolLM2's or Gemma 3 270M's (~2% of the mean) is read in full: the
    z-scores are the plain standardisation."""
    from nexus_vllm.core.policies import standardized_key_norms

    norms = torch.tensor([90.0, 92.0, 95.0, 99.0, 91.0])
    z = standardized_key_norms(norms)
    torch.testing.assert_close(z, (norms.double() - norms.double().mean())
                               / norms.double().std(unbiased=False))
    assert int(z.argmin()) == 0


def test_the_stream_prompt_end_event_reads_the_question_as_end_does():
    """In ``stream`` the event after the prompt's last token is the one prompt event that
    sees the question: it takes the prompt-end defaults (each block's best row, no walk,
    top-K), as every prefill event of ``end`` does; the events after earlier chunks keep
    the prefill defaults, and a config's ``prefill_args`` still win at both."""
    from nexus_vllm.core import EvictionConfig

    stream = EvictionConfig(method="nexus", max_tokens=1024, prompt_mode="stream")
    chunk = stream.event_policies().prefill
    end_event = stream.event_policies().prompt_end
    assert (chunk.direct, chunk.indirect, chunk.sampler) == ("mean", "walk", "pps")
    assert (end_event.direct, end_event.indirect, end_event.sampler) == ("max", "none", "topk")
    # Decode events ignore the flag (the prompt-end defaults are prefill knobs).
    policies = stream.event_policies()
    assert policies.at(prefill=False, prompt_end=True) == policies.decode
    # end and keep: every prefill event already reads the prompt-end defaults in end; keep
    # treats the prompt-end event like any prefill event.
    end = stream.replace(prompt_mode="end")
    assert end.event_policies().prefill == end.event_policies().prompt_end
    keep = stream.replace(prompt_mode="keep")
    assert keep.event_policies().prompt_end == keep.event_policies().prefill
    assert stream.replace(prefill_sampler="pps").event_policies().prompt_end.sampler == "pps"
    assert stream.evidence_kinds() >= end_event.needs
