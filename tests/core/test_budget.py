"""core/budget.py is the config's budget arithmetic (its values are checked in
tests/core/test_trigger.py); here: what each cross-field rule of EvictionConfig says it
read (ConfigError.reads), which the frontend maps to a flag or a request field."""

from __future__ import annotations

import pytest

from nexus_vllm.core import ConfigError, EvictionConfig, budget


@pytest.mark.parametrize("knobs, field, reads", [
    ({"max_tokens": 64, "keep_ratio": 0.5}, "max_tokens", ("keep_ratio",)),
    ({"max_tokens": 64}, "max_tokens", ("block_size", "sink_blocks", "recent_blocks")),
    ({"max_tokens": 1024, "prompt_mode": "stream", "prefill_budget": 2048},
     "prefill_budget", ("prompt_mode",)),
    ({"max_tokens": 1024, "prefill_budget": 512}, "prefill_budget",
     ("max_tokens", "block_size", "sink_blocks", "recent_blocks")),
    ({"max_tokens": 1024, "head_profile": "x"}, "head_profile", ("granularity",)),
    ({"max_tokens": 1024, "method": "reconstruction"}, "method", ("granularity",)),
    ({"max_tokens": 1024, "method": "streaming", "granularity": "head"}, "granularity",
     ("method",)),
    ({"method": "none", "policy_args": {"steps": 2}}, "policy_args", ("method",)),
    ({"max_tokens": 1024, "policy_args": {"stepz": 2}}, "policy_args.stepz", ("method",)),
])
def test_a_cross_field_rule_names_what_it_read(knobs, field, reads) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError) as info:
        EvictionConfig(**knobs)
    assert (info.value.field, info.value.reads) == (field, reads)


def test_a_single_field_rule_reads_nothing_else() -> None:
    with pytest.raises(ConfigError) as info:
        EvictionConfig(max_tokens=1024, interval=0)
    assert (info.value.field, info.value.reads) == ("interval", ())


def test_the_budget_is_functions_of_the_config_not_its_methods() -> None:
    cfg = EvictionConfig(max_tokens=1024, prompt_mode="end", prefill_budget=2048)
    for name in budget.__all__:
        assert not hasattr(cfg, name), name
    assert budget.target_blocks(cfg, 100, 4096) == 2048 // 32
    assert budget.evicts_mid_prompt(cfg) and not budget.evicts_mid_prompt(
        cfg.replace(prefill_budget=None))
