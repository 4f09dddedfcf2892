"""The learned stand-in for KVzip's reconstruction score (nexus_vllm.core.head_scorer):
its file format, its checks, and the config and policy that read it."""

from __future__ import annotations

import pytest
import torch

from nexus_vllm.core import ConfigError, EvictionConfig
from nexus_vllm.core.head_scorer import (
    HeadScorer,
    load_head_scorer,
    shipped_head_scorers,
)


def _scorer(layers: int = 3, hidden: int = 8, heads: int = 2, seed: int = 0) -> HeadScorer:
    g = torch.Generator().manual_seed(seed)
    return HeadScorer(model="tiny", weight=torch.randn(layers, hidden, heads, generator=g),
                      bias=torch.randn(layers, heads, generator=g), source="test")


def test_score_is_the_linear_map_per_head() -> None:
    scorer = _scorer()
    hidden = torch.randn(5, 8)
    for layer in range(3):
        expected = hidden @ scorer.weight[layer] + scorer.bias[layer]
        torch.testing.assert_close(scorer.score(layer, hidden), expected.T)
    assert scorer.score(0, hidden).shape == (2, 5)


def test_round_trips_through_a_file(tmp_path) -> None:  # noqa: ANN001
    scorer = _scorer()
    path = tmp_path / "tiny.pt"
    scorer.save(path)
    again = load_head_scorer(str(path))
    assert again.model == "tiny" and again.source == "test"
    assert torch.equal(again.weight, scorer.weight) and torch.equal(again.bias, scorer.bias)


@pytest.mark.parametrize("weight, bias", [((3, 8, 2), (3, 3)), ((8, 2), (3, 2)),
                                          ((3, 8, 2), (2, 2))])
def test_refuses_mismatched_shapes(weight, bias) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=r"\[L, D, Hkv\]"):
        HeadScorer(model="x", weight=torch.zeros(weight), bias=torch.zeros(bias))


def test_check_model_names_head_scorer() -> None:
    scorer = _scorer()
    scorer.check_model(3, 8, 2, "tiny")
    with pytest.raises(ConfigError, match=r"trained on tiny .* this model has \(3, 8, 4\)") \
            as err:
        scorer.check_model(3, 8, 4, "tiny")
    assert err.value.field == "head_scorer"


def test_unknown_or_broken_scorer_names_head_scorer(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="neither a file nor a shipped scorer") as err:
        load_head_scorer("no-such-model")
    assert err.value.field == "head_scorer"
    bad = tmp_path / "bad.pt"
    torch.save({"weight": torch.zeros(1)}, bad)
    with pytest.raises(ConfigError, match="not a head scorer") as err:
        load_head_scorer(str(bad))
    assert err.value.field == "head_scorer"


def test_the_shipped_scorer_fits_smollm2() -> None:
    assert "smollm2-135m-instruct" in shipped_head_scorers()
    scorer = load_head_scorer("smollm2-135m-instruct")
    # SmolLM2-135M: 30 layers, hidden size 576, 3 KV heads.
    assert scorer.shape == (30, 576, 3)
    assert "scripts/train_head_scorer.py" in scorer.source
    assert torch.isfinite(scorer.weight).all() and torch.isfinite(scorer.bias).all()


def test_config_reads_head_scorer_under_head_granularity_only(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "tiny.pt"
    _scorer().save(path)
    cfg = EvictionConfig.from_dict({"method": "reconstruction", "max_tokens": 256,
                                    "granularity": "head", "head_scorer": str(path)})
    assert cfg.event_policies().decode.head_needs == {"reconstruction"}
    with pytest.raises(ConfigError, match="needs granularity 'head'") as err:
        EvictionConfig.from_dict({"method": "expected", "max_tokens": 256,
                                  "head_scorer": str(path)})
    assert err.value.field == "head_scorer"
    with pytest.raises(ConfigError) as err:
        EvictionConfig.from_dict({"method": "reconstruction", "max_tokens": 256,
                                  "granularity": "head", "head_scorer": "nope"})
    assert err.value.field == "head_scorer"
    with pytest.raises(ConfigError, match="scores \\(layer, KV head, token\\) units only") \
            as err:
        EvictionConfig.from_dict({"method": "reconstruction", "max_tokens": 256})
    assert err.value.field == "method"
