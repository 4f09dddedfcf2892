"""Nexus Sampling: the window's attention (mixed with expected attention, weighted by a
key-norm prior) spread along a walk over the blocks, then exact-inclusion sampling
(docs/algorithm.md). Its knobs and what they become at prefill and prompt-end events and
in the streaming regime are declared on the class."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

import torch

from .._validate import ConfigError, check_choice, check_float, check_int
from ..evidence import Evidence
from ..head_paged import HeadEvidence
from ..sampling import SAMPLERS, sample_blocks
from ..scoring import normalize_rows
from ..weights import DIRECT_MODES, WALK_ROWS, check_indirect, nexus_weights
from .base import EvictionPolicy, PolicyState, register_policy
from .key_norm_prior import KNORM_SPREAD_FLOOR, standardized_head_norms, standardized_key_norms

__all__ = ["KNORM_SPREAD_FLOOR", "NexusPolicy"]


@register_policy
@dataclass(frozen=True)
class NexusPolicy(EvictionPolicy):
    """Nexus Sampling: direct + indirect (walk) weights, then exact-inclusion (or A-Res) sampling.

    Parameters
    ----------
    direct : {"mean", "max"}
        How the direct score reads the window's rows: their mean (the paper's), or each
        block's largest share of any one row as softmax gave it (the prompt-end event's
        default in ``end``); see :func:`~nexus_vllm.core.weights.direct_scores`.
    indirect : {"walk", "none"}
    steps : int
        Walk steps H (>= 1).
    lam : float
        Weight of the indirect score (>= 0).
    walk_rows : {"newest", "oldest", "cycle"}
    eps : float
        Recency tie-break weight (>= 0).
    sampler : {"pps", "ares", "topk"}
    n : int
        Uniforms averaged by ``ares`` (>= 1).
    knorm_prior : float
        Strength ``beta`` (>= 0) of a key-norm prior on the weights: each block's weight
        is multiplied by ``exp(-beta * z)``, ``z`` its mean key norm standardised over
        the live blocks (low-norm keys draw attention: KNorm's observation). 0, the
        default, is plain Nexus; > 0 also reads the blocks' key norms. Norms that barely
        vary (a spread under :data:`KNORM_SPREAD_FLOOR` of their mean, e.g. every key
        RMS-normalised to the same length) give a flat prior, not their rounding noise.
    expected : float
        Share ``alpha`` in [0, 1] of expected attention (query-agnostic evidence,
        :mod:`nexus_vllm.core.evidence.expected_attention`) in the evidence the walk
        and the sampler run on: every mass row becomes
        ``(1 - alpha) * row + alpha * expected`` (still a distribution over the blocks).
        0, the default, reads the window's attention only; 1 reads expected attention
        only (one row, no mass gathered).
    knorm_share : float
        Share ``gamma`` in [0, 1) of the weights drawn from the key-norm prior as a
        distribution of its own, ``softmax(-beta * z)``, *added* to the walk's normalised
        weights rather than multiplied into them: ``(1 - gamma) * w / sum(w) + gamma *
        softmax(-beta * z)``. A product lets the window's recency bias (old blocks draw
        almost no mass) override the prior; a mixture keeps the blocks either evidence
        ranks high. 0, the default, multiplies (as ``knorm_prior`` alone says); > 0
        needs ``knorm_prior`` > 0 (the prior's sharpness).
    """

    direct: str = "mean"
    indirect: str = "walk"
    steps: int = 3
    lam: float = 0.5
    walk_rows: str = "newest"
    eps: float = 1e-6
    sampler: str = "pps"
    n: int = 4
    knorm_prior: float = 0.0
    expected: float = 0.0
    knorm_share: float = 0.0

    name: ClassVar[str] = "nexus"
    # After a prompt chunk the walk runs whatever ``indirect`` says at decode (the prefill
    # ablation's winner). At the one decisive prompt-end event, with the question in the
    # window, direct attention and top-K keep the needle where the walk and pps's hedging
    # drop it (docs/algorithm.md, "The prompt-end event"); each block's best row, not the
    # rows' mean, keeps every fact a chat's question asks for ("The chat shape").
    prefill_defaults: ClassVar[Mapping[str, object]] = MappingProxyType({"indirect": "walk"})
    prompt_end_defaults: ClassVar[Mapping[str, object]] = MappingProxyType(
        {"direct": "max", "indirect": "none", "sampler": "topk"})
    # In stream every prompt event but the last runs before the question: the window's
    # attention predicts the next tokens, not a later question, so the walk and pps run
    # on query-agnostic evidence too, half expected attention and a key-norm prior (the
    # tuning sets' best; docs/algorithm.md, "The streaming regime").
    stream_defaults: ClassVar[Mapping[str, object]] = MappingProxyType(
        {"expected": 0.5, "knorm_prior": 4.0})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("direct", self.direct, DIRECT_MODES)
        check_indirect("indirect", self.indirect)
        check_choice("walk_rows", self.walk_rows, WALK_ROWS)
        check_choice("sampler", self.sampler, SAMPLERS)
        # Upper bounds keep a typo from making scoring arbitrarily slow or overflowing.
        check_int("steps", self.steps, low=1, high=64)
        check_int("n", self.n, low=1, high=1024)
        check_float("lam", self.lam, low=0.0, high=1e6)
        check_float("eps", self.eps, low=0.0)
        check_float("knorm_prior", self.knorm_prior, low=0.0, high=100.0)
        check_float("expected", self.expected, low=0.0, high=1.0)
        check_float("knorm_share", self.knorm_share, low=0.0, high=0.999)
        if self.knorm_share > 0 and self.knorm_prior <= 0:
            raise ConfigError(
                "knorm_share", f"knorm_share={self.knorm_share} mixes in the key-norm prior, whose "
                "sharpness is knorm_prior: set knorm_prior > 0 as well")

    @property
    def needs(self) -> frozenset[str]:
        needs = set(self.evidence)
        if self.knorm_prior > 0:
            needs.add("key_norms")
        if self.expected > 0:
            needs.add("expected_attention")
        if self.expected >= 1:
            needs.discard("mass")
        return frozenset(needs)

    @property
    def head_needs(self) -> frozenset[str]:
        needs = {"mass"} if self.expected < 1 else set()
        if self.expected > 0:
            needs.add("expected_attention")
        if self.knorm_prior > 0:
            needs.add("key_norms")
        return frozenset(needs)

    @property
    def head_sampler(self) -> str:
        return self.sampler

    def head_score(self, evidence: HeadEvidence) -> torch.Tensor:
        """Per unit: the window's attention mixed with expected attention by
        :attr:`expected`, times the key-norm prior standardised within each (layer, head).
        The walk does not run per head: a unit's weight is its direct evidence."""
        alpha = float(self.expected)
        score = torch.zeros(evidence.live.shape, dtype=torch.float32)
        if alpha < 1:
            score = score + (1.0 - alpha) * evidence["mass"]
        if alpha > 0:
            score = score + alpha * evidence["expected_attention"]
        if self.knorm_prior > 0:
            score = score * torch.exp(-self.knorm_prior * standardized_head_norms(
                evidence["key_norms"], evidence.live))
        return score

    def combined_mass(self, evidence: Evidence) -> torch.Tensor:
        """The rows the walk and the sampler read: the window's mass mixed with expected
        attention by :attr:`expected` (``[W, N]``; one row when ``expected`` is 1)."""
        alpha = float(self.expected)
        if alpha <= 0:
            return evidence.mass
        expected = evidence["expected_attention"].to(torch.float64).view(1, -1)
        if alpha >= 1:
            return expected
        mass = evidence.mass.to(torch.float64)
        return (1.0 - alpha) * mass + alpha * expected

    @property
    def stochastic(self) -> bool:
        return self.sampler != "topk"

    def score(self, evidence: Evidence, state: PolicyState | None) -> torch.Tensor:
        weights = nexus_weights(
            self.combined_mass(evidence),
            row_scale=evidence.row_scale if self.expected < 1 else None,
            direct=self.direct,
            indirect=self.indirect,
            steps=self.steps,
            lam=self.lam,
            walk_rows=self.walk_rows,
            eps=self.eps,
        )
        return weights

    def reweight(self, weights: torch.Tensor, evidence: Evidence) -> torch.Tensor:
        if self.knorm_prior <= 0:
            return weights
        assert evidence.key_norms is not None  # select() checks what the policy needs
        z = standardized_key_norms(evidence.key_norms.detach().to(weights.device))
        if self.knorm_share > 0:
            gamma = float(self.knorm_share)
            prior = torch.softmax(-self.knorm_prior * z, dim=0).to(weights.dtype)
            return (1.0 - gamma) * normalize_rows(weights) + gamma * prior
        return weights * torch.exp(-self.knorm_prior * z).to(weights.dtype)

    def choose(self, weights: torch.Tensor, k: int,
               generator: torch.Generator | None) -> torch.Tensor:
        return sample_blocks(weights, k, sampler=self.sampler, n=self.n, generator=generator)
