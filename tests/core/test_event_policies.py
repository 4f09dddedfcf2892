"""EventPolicies: the policy of each event kind of a request, resolved once, tested as
one (the three kinds per prompt mode, the forced set, who holds it, the table)."""

from __future__ import annotations

import pathlib
import re

import pytest

from nexus_vllm.core import POLICIES, EvictionConfig, get_policy
from nexus_vllm.core.event_policies import EVENT_KINDS, EventPolicies, event_kind

from .policy_cases import POLICY_CASES

REPO = pathlib.Path(__file__).resolve().parents[2]


def _nexus(mode: str, **extra: object) -> EventPolicies:
    return EvictionConfig.from_dict({"method": "nexus", "max_tokens": 1024,
                                     "prompt_mode": mode, **extra}).event_policies()


def test_each_prompt_mode_resolves_the_three_event_kinds() -> None:
    """The overlays as one table per prompt mode: decode reads policy_args (over the
    stream defaults in stream), a prompt chunk the prefill defaults, the prompt-end event
    (every prefill event in end) the prompt-end defaults."""
    def row(p: object) -> tuple[object, ...]:
        return tuple(getattr(p, k) for k in ("direct", "indirect", "sampler", "expected",
                                             "knorm_prior"))

    want = {
        "stream": {"decode": ("mean", "walk", "pps", 0.5, 4.0),
                   "prefill": ("mean", "walk", "pps", 0.5, 4.0),
                   "prompt_end": ("max", "none", "topk", 0.5, 4.0)},
        "end": {"decode": ("mean", "walk", "pps", 0.0, 0.0),
                "prefill": ("max", "none", "topk", 0.0, 0.0),
                "prompt_end": ("max", "none", "topk", 0.0, 0.0)},
        "keep": {"decode": ("mean", "walk", "pps", 0.0, 0.0),
                 "prefill": ("mean", "walk", "pps", 0.0, 0.0),
                 "prompt_end": ("mean", "walk", "pps", 0.0, 0.0)},
    }
    for mode, rows in want.items():
        policies = _nexus(mode)
        assert {kind: row(p) for kind, p in policies.items()} == rows, mode
        assert [k for k, _ in policies.items()] == list(EVENT_KINDS)
    # prefill_args win over the declared defaults at prefill events only.
    over = _nexus("stream", prefill_sampler="ares")
    assert (over.decode.sampler, over.prefill.sampler, over.prompt_end.sampler) \
        == ("pps", "ares", "ares")


def test_at_selects_by_the_trigger_event_kind() -> None:
    policies = _nexus("stream")
    assert policies.at(prefill=False) is policies.decode
    assert policies.at(prefill=False, prompt_end=True) is policies.decode
    assert policies.at(prefill=True) is policies.prefill
    assert policies.at(prefill=True, prompt_end=True) is policies.prompt_end
    assert [event_kind(prefill=p, prompt_end=e) for p, e in
            ((False, False), (False, True), (True, False), (True, True))] \
        == ["decode", "decode", "prefill", "prompt_end"]
    assert policies.needs == {"mass", "expected_attention", "key_norms"}
    assert policies.stochastic  # decode and prompt chunks sample


@pytest.mark.parametrize("case", POLICY_CASES, ids=lambda c: c.name)
def test_every_policy_resolves_with_the_config_forced_set(case) -> None:
    granularity = "head" if case.head_only else "block"
    cfg = EvictionConfig.from_dict({"method": case.name, "max_tokens": 1024,
                                    "sink_blocks": 2, "recent_blocks": 3, "carry": 2,
                                    "granularity": granularity, **dict(case.knobs)})
    policies = cfg.event_policies()
    for _, policy in policies.items():
        assert type(policy) is POLICIES[case.name]
        assert (policy.sink_blocks, policy.recent_blocks, policy.carry) == (2, 3, 2)
    assert policies.decode == get_policy(case.name, sink_blocks=2, recent_blocks=3, carry=2,
                                         **dict(case.knobs))
    assert cfg.evidence_kinds() == policies.needs


def test_keep_mode_prompt_blocks_join_the_sinks() -> None:
    cfg = EvictionConfig(method="nexus", max_tokens=1024, prompt_mode="keep", block_size=32)
    policies = cfg.event_policies(prompt_tokens=100)
    assert {p.sink_blocks for _, p in policies.items()} == {4}  # ceil(100 / 32)
    assert cfg.replace(prompt_mode="end").event_policies(100).decode.sink_blocks == 1


def test_the_scheduler_and_the_session_hold_the_config_resolution() -> None:
    from nexus_vllm.integration.scheduler.request_state import RequestEvictionState

    cfg = EvictionConfig(method="nexus", max_tokens=1024, prompt_mode="keep")
    st = RequestEvictionState(req_id="r", cfg=cfg, seed=0, prompt_tokens=300)
    assert st.policies == cfg.event_policies(300)
    st.restart()  # a restart keeps the request's resolution
    assert st.policies == cfg.event_policies(300)


def test_the_table_names_every_event_and_knob() -> None:
    table = _nexus("stream").table()
    lines = table.splitlines()
    assert lines[0].split() == ["event", "policy", "sink/recent/carry", "reads", "knobs"]
    assert [line.split()[0] for line in lines[1:]] == list(EVENT_KINDS)
    assert "direct='max'" in lines[3] and "sampler='topk'" in lines[3]
    assert "1/2/1" in lines[1]  # the config's forced set and carry
    assert "expected_attention, key_norms, mass" in lines[1]


def test_one_place_builds_an_event_policy() -> None:
    """No production module builds a config's policy or overlays its knobs but
    core/event_policies.py (get_policy builds one by name, from the caller's knobs)."""
    found = []
    for path in (REPO / "nexus_vllm").rglob("*.py"):
        text = path.read_text()
        for pattern in (r"POLICIES\[[^\]]+\]\(", r"prompt_end_defaults\b(?!:)",
                        r"\.policy\(prefill"):
            if re.search(pattern, text):
                found.append((path.relative_to(REPO).as_posix(), pattern))
    places = {p for p, _ in found if not p.startswith("nexus_vllm/core/policies/")}
    assert places == {"nexus_vllm/core/event_policies.py"}, found
