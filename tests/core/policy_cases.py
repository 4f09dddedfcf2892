"""The policy case table: one row per registered policy, read by every policy test.

A new policy needs one row here (``test_case_table_covers_every_policy`` fails without
it); the tests in ``tests/core/test_policies.py`` and ``tests/hf/test_streaming.py`` then
check it like the others: its declared properties, a hand-checked selection, its knobs
through ``EvictionConfig`` (a bad one refused at construction), and the transformers path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nexus_vllm.core import Evidence

__all__ = ["HAND_BUDGET", "HAND_EVIDENCE", "HAND_FORCED", "POLICY_CASES", "PolicyCase"]


@dataclass(frozen=True)
class PolicyCase:
    """One policy as the tests see it.

    Parameters
    ----------
    name : str
        The registered name (``POLICIES`` key).
    knobs : Mapping[str, Any]
        Knobs the row's policy is built with (non-default where the policy has knobs).
    stochastic, needs, query_rows :
        What the policy built with ``knobs`` must declare.
    keep : tuple of int, optional
        Blocks it keeps on :data:`HAND_EVIDENCE` at :data:`HAND_BUDGET` (worked out by
        hand below); None for a stochastic policy, whose choice must vary with the seed.
    bad_knob : (str, Any), optional
        A knob and a value out of its range, refused when the config is built.
    head_only : bool
        The policy scores (layer, KV head, token) units only: no block selection to
        check, and a block-granular config is refused.
    """

    name: str
    knobs: Mapping[str, Any] = field(default_factory=dict)
    stochastic: bool = False
    needs: frozenset[str] = frozenset({"mass"})
    query_rows: int | None = None
    keep: tuple[int, ...] | None = None
    bad_knob: tuple[str, Any] | None = None
    head_only: bool = False


# Eight blocks, one sink and one recent block: the forced set is {0, 6, 7}, so a budget of
# 5 leaves two picks among the candidates 1..5.
#                     0     1     2     3     4     5     6     7
_MASS = torch.tensor([[0.10, 0.05, 0.40, 0.05, 0.10, 0.10, 0.10, 0.10],   # older query
                      [0.10, 0.30, 0.05, 0.05, 0.20, 0.10, 0.10, 0.10]])  # newest query
_KEY_NORMS = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.5, 0.7, 1.0, 1.0])
_EXPECTED = torch.tensor([0.10, 0.02, 0.08, 0.30, 0.05, 0.25, 0.10, 0.10])
HAND_EVIDENCE = Evidence(_MASS, _KEY_NORMS, expected_attention=_EXPECTED)
HAND_BUDGET = 5
HAND_SINKS, HAND_RECENT = 1, 1
HAND_FORCED = (0, 6, 7)
# Candidate column sums: 1: .35, 2: .45, 3: .10, 4: .30, 5: .20; the newest row alone:
# 1: .30, 4: .20; the lowest key norms: 2 (0.5), 5 (0.7); the most expected attention:
# 3 (.30), 5 (.25).

POLICY_CASES: tuple[PolicyCase, ...] = (
    # lam 0 and top-K: the direct score alone (the mean row, ranked as the column sums).
    PolicyCase("nexus", {"sampler": "topk", "lam": 0.0, "steps": 2}, keep=(0, 1, 2, 6, 7),
               bad_knob=("sampler", "gumbel")),
    PolicyCase("h2o", keep=(0, 1, 2, 6, 7)),  # first event: the column sums
    PolicyCase("snapkv", keep=(0, 1, 2, 6, 7)),  # column sums
    PolicyCase("tova", query_rows=1, keep=(0, 1, 4, 6, 7)),  # the newest row
    PolicyCase("streaming", needs=frozenset(), keep=(0, 4, 5, 6, 7)),  # the newest blocks
    PolicyCase("random", needs=frozenset(), stochastic=True),
    PolicyCase("knorm", needs=frozenset({"key_norms"}), keep=(0, 2, 5, 6, 7)),  # lowest norms
    PolicyCase("expected", needs=frozenset({"expected_attention"}),
               keep=(0, 3, 5, 6, 7)),  # the most expected attention
    # The learned stand-in for KVzip's score exists per (layer, KV head, token) only
    # (tests/core/test_head_scorer.py, tests/hf/test_head_granularity.py).
    PolicyCase("reconstruction", needs=frozenset(), head_only=True),
)
