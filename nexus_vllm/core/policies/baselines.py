"""The baselines, one small policy each: H2O, SnapKV, TOVA, StreamingLLM, random, KNorm,
expected attention alone and KVzip's reconstruction score (head granularity only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..evidence import Evidence
from ..head_evidence import HeadEvidence
from .base import EvictionPolicy, PolicyState, register_policy
from .key_norm_prior import key_norms_are_flat

__all__ = ["ExpectedAttentionPolicy", "H2OPolicy", "KNormPolicy", "RandomPolicy",
           "ReconstructionPolicy", "SnapKVPolicy", "StreamingPolicy", "TOVAPolicy"]


@register_policy
@dataclass(frozen=True)
class H2OPolicy(EvictionPolicy):
    """Heavy hitters: attention mass accumulated over every event (kept in ``state``)."""

    name: ClassVar[str] = "h2o"
    STATE_KEY: ClassVar[str] = "h2o_cumulative_mass"

    def score(self, evidence: Evidence, state: PolicyState | None) -> torch.Tensor:
        current = evidence.mass.detach().to("cpu", torch.float64).sum(dim=0)
        if state is None:
            return current
        previous = state.get(self.STATE_KEY)
        if previous is not None:
            if previous.numel() > current.numel():
                raise ValueError(
                    f"state holds {previous.numel()} blocks but mass has {current.numel()}: "
                    "pass the live blocks in order, new ones appended"
                )
            current[: previous.numel()] += previous
        state[self.STATE_KEY] = current
        return current

    def after_select(self, keep: torch.Tensor, state: PolicyState | None) -> None:
        if state is not None and self.STATE_KEY in state:
            state[self.STATE_KEY] = state[self.STATE_KEY][keep]


@register_policy
@dataclass(frozen=True)
class SnapKVPolicy(EvictionPolicy):
    """SnapKV at block level: column sums of the window's attention (no token pooling)."""

    name: ClassVar[str] = "snapkv"
    head_kind: ClassVar[str | None] = "mass"

    def score(self, evidence: Evidence, state: PolicyState | None) -> torch.Tensor:
        return evidence.mass.detach().to("cpu", torch.float64).sum(dim=0)


@register_policy
@dataclass(frozen=True)
class TOVAPolicy(EvictionPolicy):
    """TOVA: the newest query's attention row only."""

    name: ClassVar[str] = "tova"
    query_rows: ClassVar[int | None] = 1
    head_kind: ClassVar[str | None] = "mass"

    def score(self, evidence: Evidence, state: PolicyState | None) -> torch.Tensor:
        mass = evidence.mass
        if mass.shape[0] == 0:
            return torch.zeros(mass.shape[1], dtype=torch.float64)
        return mass[-1].detach().to("cpu", torch.float64)


@register_policy
@dataclass(frozen=True)
class StreamingPolicy(EvictionPolicy):
    """StreamingLLM: sinks plus the most recent blocks; no scores needed."""

    name: ClassVar[str] = "streaming"
    evidence: ClassVar[frozenset[str]] = frozenset()

    def score(self, evidence: Evidence, state: PolicyState | None) -> torch.Tensor:
        return torch.arange(evidence.num_blocks, dtype=torch.float64)


@register_policy
@dataclass(frozen=True)
class RandomPolicy(EvictionPolicy):
    """Uniformly random among the non-forced blocks."""

    name: ClassVar[str] = "random"
    evidence: ClassVar[frozenset[str]] = frozenset()

    @property
    def stochastic(self) -> bool:
        return True

    def score(self, evidence: Evidence, state: PolicyState | None) -> torch.Tensor:
        return torch.ones(evidence.num_blocks, dtype=torch.float64)

    def choose(self, weights: torch.Tensor, k: int,
               generator: torch.Generator | None) -> torch.Tensor:
        return torch.randperm(weights.numel(), generator=generator)[:k]


@register_policy
@dataclass(frozen=True)
class KNormPolicy(EvictionPolicy):
    """Keep the blocks with the lowest mean key norm (high-norm keys draw little attention)."""

    name: ClassVar[str] = "knorm"
    evidence: ClassVar[frozenset[str]] = frozenset({"key_norms"})
    head_kind: ClassVar[str | None] = "key_norms"

    def head_score(self, evidence: HeadEvidence) -> torch.Tensor:
        return -evidence["key_norms"]

    def score(self, evidence: Evidence, state: PolicyState | None) -> torch.Tensor:
        assert evidence.key_norms is not None  # select() checks what the policy needs
        norms = evidence.key_norms.detach().to("cpu", torch.float64)
        if key_norms_are_flat(norms):
            # Keys of one length (RMS-normalised heads): rounding, which differs between
            # kernels and TP layouts, would pick the blocks; a tie keeps the older ones.
            return torch.zeros_like(norms)
        return -norms


@register_policy
@dataclass(frozen=True)
class ExpectedAttentionPolicy(EvictionPolicy):
    """Expected attention alone, top-K: the blocks the queries still to come are expected
    to attend to, from the statistics of the recent queries (kvpress's
    ``ExpectedAttentionPress`` at block level, without its value-norm factor; reads no
    attention of the window)."""

    name: ClassVar[str] = "expected"
    evidence: ClassVar[frozenset[str]] = frozenset({"expected_attention"})
    head_kind: ClassVar[str | None] = "expected_attention"

    def score(self, evidence: Evidence, state: PolicyState | None) -> torch.Tensor:
        return evidence["expected_attention"].detach().to("cpu", torch.float64)


@register_policy
@dataclass(frozen=True)
class ReconstructionPolicy(EvictionPolicy):
    """KVzip's reconstruction score per (layer, KV head, token), top-K by one threshold
    over all of them, read from a learned stand-in
    (:class:`~nexus_vllm.core.head_scorer.HeadScorer`, the config's ``head_scorer``): each
    token's predicted ``log`` score, computed once when it is fed. Granularity ``head``
    only; the transformers path runs it."""

    name: ClassVar[str] = "reconstruction"
    evidence: ClassVar[frozenset[str]] = frozenset()
    head_only: ClassVar[bool] = True
    head_kind: ClassVar[str | None] = "reconstruction"

    def score(self, evidence: Evidence, state: PolicyState | None) -> torch.Tensor:
        raise ValueError("policy 'reconstruction' scores (layer, KV head, token) units only: "
                         "it needs granularity 'head'")
