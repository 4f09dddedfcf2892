"""The oracle in the streaming regime: the answers' blocks kept first, at every event.

At a budget, how much of the gap to dense is the evidence's fault? The oracle knows where
every reference answer is mentioned before the question (a needle's sentence, a fact an
earlier turn stated) and keeps those blocks at every event, prompt events included; the
rest of the budget goes to its base policy's choice (Nexus with the run's knobs, so in
``stream`` the shipped stream defaults). What it loses is what the budget, the forced set
and the blocks around the answers cost, not the evidence. Offline only (the transformers
path): no server knows the answers.

Method spec ``oracle`` (or ``oracle:<nexus knobs>``) in ``nexus-vllm eval``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from nexus_vllm.core import EvictionConfig, EvictionPolicy, Evidence
from nexus_vllm.core.event_policies import EventPolicyKind

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ORACLE", "ORACLE_BASE", "ORACLE_LEAD", "OracleConfig", "OracleFirst",
           "answer_blocks", "oracle_config"]

# The method name and the policy its choice beyond the answers comes from.
ORACLE = "oracle"
ORACLE_BASE = "nexus"
# Tokens before an answer's mention that the oracle also keeps (where its key is).
ORACLE_LEAD = 24
# Per-request state: the logical block (position // block size) of each live block.
_LIVE = "oracle_live_blocks"
_SCORED = "oracle_scored_blocks"  # the same, for the event being chosen


def answer_blocks(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], answers: Iterable[str], *, end: int,
                  block_size: int, lead: int = ORACLE_LEAD) -> tuple[int, ...]:
    """Logical blocks holding a mention of an answer among ``ids[:end]``.

    Parameters
    ----------
    tokenizer : transformers tokenizer
    ids : sequence of int
        The token ids a request streams (chat template and all).
    answers : iterable of str
        Reference answers; every occurrence in the decoded text counts.
    end : int
        Tokens searched (the question's start: its own words are not a mention).
    block_size : int
    lead : int
        Tokens before a mention kept with it.

    Returns
    -------
    tuple of int, sorted: ``range((t0 - lead) // block_size, (t1 - 1) // block_size + 1)``
    for each mention's token range ``[t0, t1)``.
    """
    ids = list(ids)[:end]
    text = str(tokenizer.decode(ids))

    def tokens_before(char: int) -> int:
        # The fewest leading tokens whose decoding reaches past ``char`` (binary search:
        # decoding every prefix would be quadratic).
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(tokenizer.decode(ids[:mid + 1])) > char:
                hi = mid
            else:
                lo = mid + 1
        return lo

    blocks: set[int] = set()
    for answer in answers:
        if not answer:
            continue
        for m in re.finditer(re.escape(answer), text):
            t0 = tokens_before(m.start())
            t1 = tokens_before(m.end() - 1) + 1
            blocks.update(range(max(0, t0 - lead) // block_size, (t1 - 1) // block_size + 1))
    return tuple(sorted(blocks))


@dataclass(frozen=True)
class OracleFirst(EvictionPolicy):
    """``base``'s weights normalised, plus 1 on every live block in ``answer_blocks``.

    With the base's sampler (pps or top-K) every answer block then outranks the rest
    (pps: inclusion probability 1) whenever the budget beyond the forced set covers
    them. Which logical block each live block is gets tracked in the per-request
    ``state`` across events: new blocks follow the newest live one, which the forced set
    always keeps (``recent_blocks`` >= 1).
    """

    base: EvictionPolicy | None = None
    answer_blocks: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.base is None:
            raise ValueError("OracleFirst needs a base policy")
        if self.recent_blocks < 1:
            raise ValueError("the oracle tracks blocks through the newest one: "
                             "recent_blocks must be >= 1")

    @property
    def needs(self) -> frozenset[str]:
        assert self.base is not None
        return self.base.needs

    @property
    def stochastic(self) -> bool:
        assert self.base is not None
        return self.base.stochastic

    def window(self, window: int) -> int:
        assert self.base is not None
        return self.base.window(window)

    @staticmethod
    def _live(state: dict[str, Any], n: int) -> torch.Tensor:
        prev = state.get(_LIVE)
        if prev is None:
            return torch.arange(n)
        fresh = n - int(prev.numel())
        if fresh < 0:
            raise ValueError(f"{n} live blocks, fewer than the {prev.numel()} kept last event")
        return torch.cat([prev, int(prev[-1]) + 1 + torch.arange(fresh)])

    def keep_weights(self, evidence: Evidence, state: dict[str, Any] | None) -> torch.Tensor:
        """The base's weights (its carry and prior included) normalised, plus 1 on the
        answer blocks and, by ``carry``, on the blocks right after them."""
        assert self.base is not None
        if state is None:
            raise ValueError("the oracle needs the per-request state")
        w = self.base.keep_weights(evidence, state)
        w = w - w.min()
        w = w / w.sum().clamp_min(1e-12)
        live = state[_SCORED] = self._live(state, evidence.num_blocks)
        wanted = torch.tensor(sorted(self.answer_blocks), dtype=torch.long)
        return w + self.carried(torch.isin(live, wanted).to(w.dtype))

    def choose(self, weights: torch.Tensor, k: int,
               generator: torch.Generator | None) -> torch.Tensor:
        assert self.base is not None
        return self.base.choose(weights, k, generator)

    def after_select(self, keep: torch.Tensor, state: dict[str, Any] | None) -> None:
        assert self.base is not None and state is not None  # score() refused None
        self.base.after_select(keep, state)
        state[_LIVE] = state.pop(_SCORED)[keep]


@dataclass(frozen=True)
class OracleConfig(EvictionConfig):
    """An :class:`EvictionConfig` whose policy is :class:`OracleFirst` over its own."""

    answer_blocks: tuple[int, ...] = ()

    def event_policy(self, kind: EventPolicyKind, prompt_tokens: int = 0
                     ) -> EvictionPolicy:
        base = super().event_policy(kind, prompt_tokens)
        return OracleFirst(sink_blocks=base.sink_blocks, recent_blocks=base.recent_blocks,
                           carry=base.carry, base=base,
                           answer_blocks=frozenset(self.answer_blocks))


def oracle_config(config: EvictionConfig, blocks: Iterable[int]) -> OracleConfig:
    """``config`` (its method the oracle's base) with the answers' ``blocks`` kept first."""
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    return OracleConfig(**values, answer_blocks=tuple(sorted(set(blocks))))
