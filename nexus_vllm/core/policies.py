"""Eviction policies: one small frozen dataclass each, sharing the forced set.

A policy sees the :class:`~nexus_vllm.core.evidence.Evidence` of one request's event (a
mapping from evidence kind to tensor over its live blocks in logical order: the window's
attention mass ``[W, N]``, key norms, expected attention; :mod:`nexus_vllm.core.evidence`)
and returns the blocks to KEEP. Every policy keeps the forced set: the first
``sink_blocks`` blocks (the attention sink), the newest ``recent_blocks`` full blocks and
the current (last) block. The rest of the budget is filled by
:meth:`EvictionPolicy.score` and the policy's sampler.

A policy declares what it needs, so callers ask it instead of testing its name:
``needs`` (which evidence it reads), ``query_rows`` (how many of the newest window rows of
the mass it reads: the scorer computes no more) and ``stochastic`` (whether its choice
depends on the generator). The vLLM plugin serves every policy: each evidence kind has a
worker gatherer (:mod:`nexus_vllm.core.evidence`). Its knobs are its dataclass fields
(:meth:`EvictionPolicy.knobs`), and what they become at prefill events is declared here
too (``prefill_defaults``, ``prompt_end_defaults``), so
:class:`~nexus_vllm.core.EvictionConfig` names no knob of any policy.

Adding a policy is one ``@register_policy`` class plus one row in the tests' case table
(``tests/core/policy_cases.py``). The class may live in another module: :data:`METHODS`
reads the registry when asked, so configs, the server's flags, request validation and the
evaluation CLI accept it as soon as it is registered.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

import torch

from ._validate import ConfigError, check_choice, check_float, check_int
from .evidence import Evidence
from .head_paged import HeadEvidence
from .sampling import SAMPLERS, sample_blocks, top_k_indices
from .scoring import normalize_rows
from .weights import DIRECT_MODES, WALK_ROWS, check_indirect, nexus_weights

__all__ = [
    "METHODS",
    "POLICIES",
    "Evidence",
    "EvictionPolicy",
    "ExpectedAttentionPolicy",
    "H2OPolicy",
    "KNORM_SPREAD_FLOOR",
    "key_norms_are_flat",
    "KNormPolicy",
    "MethodNames",
    "NexusPolicy",
    "RandomPolicy",
    "ReconstructionPolicy",
    "SnapKVPolicy",
    "StreamingPolicy",
    "TOVAPolicy",
    "carry_forward",
    "forced_blocks",
    "forced_count",
    "forced_tail",
    "get_policy",
    "head_granular_methods",
    "register_policy",
    "standardized_head_norms",
    "standardized_key_norms",
]

def forced_tail(recent_blocks: int) -> int:
    """How many of the newest live blocks are forced: the ``recent_blocks`` newest full
    blocks and the current one."""
    return int(recent_blocks) + 1


def forced_count(sink_blocks: int, recent_blocks: int) -> int:
    """Blocks the forced set takes once a sequence is long enough: the sinks and the
    :func:`forced_tail` (the one formula every budget floor and check reads)."""
    return int(sink_blocks) + forced_tail(recent_blocks)


def forced_blocks(num_blocks: int, sink_blocks: int, recent_blocks: int) -> torch.Tensor:
    """Indices that are never evicted: sinks, the ``recent_blocks`` newest full blocks and
    the current (last) block.

    Returns
    -------
    LongTensor[F] sorted ascending, ``F <= num_blocks``.
    """
    mask = torch.zeros(num_blocks, dtype=torch.bool)
    mask[: min(sink_blocks, num_blocks)] = True
    mask[max(0, num_blocks - forced_tail(recent_blocks)) :] = True
    return torch.nonzero(mask).flatten()


# The smallest spread of the blocks' key norms, as a share of their mean, that the
# key-norm prior reads as signal. Models that RMS-normalise each head's keys (Gemma 3's
# k_norm) can give every key the same length; standardising that by its own spread
# would turn float rounding (~1e-7, different on each TP layout) into a strong random
# prior. Real spreads are far above it (SmolLM2, Gemma 3 270M: 1.5-3% of the mean).
KNORM_SPREAD_FLOOR = 1e-3


def standardized_key_norms(norms: torch.Tensor) -> torch.Tensor:
    """Blocks' key norms as z-scores, the spread floored at ``KNORM_SPREAD_FLOOR * mean``.

    Parameters
    ----------
    norms : Tensor[N]
        Mean key norm of each live block.

    Returns
    -------
    Tensor[N] (float64): ``(norms - mean) / max(std, KNORM_SPREAD_FLOOR * |mean|)``;
    near-constant norms give near-zero z (a flat prior).
    """
    x = norms.to(torch.float64).flatten()
    mean = x.mean()
    floor = (KNORM_SPREAD_FLOOR * mean.abs()).clamp(min=1e-12)
    return (x - mean) / torch.maximum(x.std(unbiased=False), floor)


def key_norms_are_flat(norms: torch.Tensor) -> bool:
    """Whether the blocks' key norms (Tensor[N]) spread less than ``KNORM_SPREAD_FLOOR``
    of their mean: every key the same length up to rounding, so their order is noise."""
    x = norms.to(torch.float64).flatten()
    return bool(x.std(unbiased=False) < KNORM_SPREAD_FLOOR * x.mean().abs())


def standardized_head_norms(norms: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Key norms ``[L, H, T]`` standardised within each (layer, head) over its live
    entries (0 on dead ones, and where a head's norms are flat:
    :data:`KNORM_SPREAD_FLOOR`)."""
    w = live.float()
    count = w.sum(dim=-1, keepdim=True).clamp_min(1.0)
    mean = (norms * w).sum(dim=-1, keepdim=True) / count
    std = (((norms - mean) * w).square().sum(dim=-1, keepdim=True) / count).sqrt()
    std = torch.maximum(std, KNORM_SPREAD_FLOOR * mean.abs()).clamp_min(1e-12)
    return ((norms - mean) / std * w).float()


def carry_forward(weights: torch.Tensor, carry: int) -> torch.Tensor:
    """Each block's weight raised to the largest of the ``carry`` blocks before it:
    ``w'_j = max(w_j, w_{j-1}, ..., w_{j-carry})``.

    Attention that finds a fact lands on the tokens that match the question (a needle's
    key), and the fact often ends in the next block (its value): a 25-token sentence
    straddles a 32-token block boundary three times in four. Carrying weight forward
    keeps that continuation (docs/algorithm.md, "Continuation").

    Parameters
    ----------
    weights : Tensor[N]
    carry : int
        Blocks to look back (0: unchanged).
    """
    out = weights
    for shift in range(1, min(int(carry), weights.numel() - 1) + 1):
        prev = torch.cat([weights[:shift], weights[:-shift]])
        out = torch.maximum(out, prev)
    return out


@dataclass(frozen=True)
class EvictionPolicy:
    """Base class: forced set + ``score()`` + a sampler.

    Parameters
    ----------
    sink_blocks : int
        Oldest blocks always kept (>= 1: the attention sink).
    recent_blocks : int
        Newest full blocks always kept besides the current block (>= 0).
    carry : int
        Policies that read attention mass: each block's weight is raised to that of the
        ``carry`` blocks before it (:func:`carry_forward`; 0: off, at most 4).
    """

    sink_blocks: int = 1
    recent_blocks: int = 4
    carry: int = 0

    name: ClassVar[str] = "base"
    # Knob overrides at prefill events (after a prompt chunk, and the prompt-end event):
    # in prompt_mode "stream" and "keep", and in "end". A config's own prefill_args win.
    prefill_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    prompt_end_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    # Knob defaults at every event (decode included) in prompt_mode "stream", where every
    # prompt event but the last runs before the question is seen; a config's policy_args
    # win, and prefill events apply prefill_defaults over them.
    stream_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    # Evidence read by score(): "mass" and/or "key_norms"; empty for score-free policies.
    evidence: ClassVar[frozenset[str]] = frozenset({"mass"})
    # Newest rows of the window's mass that score() reads (None: all of them).
    query_rows: ClassVar[int | None] = None
    # A policy whose score exists per (layer, KV head, token) only: granularity "head".
    head_only: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_int("sink_blocks", self.sink_blocks, low=1)
        check_int("recent_blocks", self.recent_blocks, low=0)
        check_int("carry", self.carry, low=0, high=4)

    @classmethod
    def knobs(cls) -> tuple[str, ...]:
        """The policy's own settings: its fields besides the forced set's (which the
        config holds for every policy)."""
        shared = {f.name for f in fields(EvictionPolicy)}
        return tuple(f.name for f in fields(cls) if f.name not in shared)

    @property
    def num_forced(self) -> int:
        """Blocks the forced set takes once a sequence is long enough."""
        return forced_count(self.sink_blocks, self.recent_blocks)

    @property
    def needs(self) -> frozenset[str]:
        """The evidence this instance reads (its class's, unless a knob adds some)."""
        return self.evidence

    @property
    def stochastic(self) -> bool:
        """Whether the kept set depends on the generator (several seeds are informative)."""
        return False

    def window(self, window: int) -> int:
        """Query rows worth scoring out of a ``window`` (fewer for ``query_rows``)."""
        return window if self.query_rows is None else min(window, self.query_rows)

    def score(self, evidence: Evidence, state: dict[str, Any] | None) -> torch.Tensor:
        """Per-block keep weight from the evidence, Tensor[N]; larger means more worth
        keeping. The one method a policy overrides; :meth:`keep_weights` carries it and
        applies :meth:`reweight` before the sampler reads it.

        ``state`` is the caller-owned per-request dict (None when the caller keeps none).
        """
        raise NotImplementedError

    @property
    def head_needs(self) -> frozenset[str]:
        """The per-head evidence (:data:`~nexus_vllm.core.head_paged.HEAD_KINDS`) that
        :meth:`head_score` reads; empty: the policy has no per-head score and cannot run
        at ``granularity`` ``head``."""
        return frozenset()

    @property
    def head_sampler(self) -> str:
        """How head granularity picks units past the forced set (one threshold: topk)."""
        return "topk"

    def head_score(self, evidence: HeadEvidence) -> torch.Tensor:
        """Keep weight of every (layer, KV head, token) unit, Tensor[L, Hkv, T]; one
        threshold over all of them spends the budget (:mod:`~nexus_vllm.core.head_paged`)."""
        raise ValueError(f"policy {self.name!r} has no per-head score: granularity 'head' "
                         f"takes {', '.join(head_granular_methods())}")

    def reweight(self, weights: torch.Tensor, evidence: Evidence) -> torch.Tensor:
        """Factors that belong to each block itself, applied after ``carry`` (the
        identity here; Nexus's key-norm prior). ``weights`` is Tensor[N] float64 (CPU);
        returns Tensor[N]."""
        return weights

    def keep_weights(self, evidence: Evidence, state: dict[str, Any] | None) -> torch.Tensor:
        """The weights the sampler reads, Tensor[N] float64 (CPU): :meth:`score`, carried
        forward (:func:`carry_forward`) when the policy reads attention and ``carry`` is
        set, then :meth:`reweight`. A successor inherits a block's attention (a fact's
        value follows its key), never a block's own prior (its key norms)."""
        n = evidence.num_blocks
        weights = self.score(evidence, state).detach().to("cpu", torch.float64)
        if weights.shape != (n,):
            raise ValueError(
                f"{self.name}.score returned shape {tuple(weights.shape)}, want ({n},)"
            )
        return self.reweight(self.carried(weights), evidence)

    def carried(self, weights: torch.Tensor) -> torch.Tensor:
        """``weights`` (Tensor[N]) carried forward by ``carry`` blocks when the policy reads
        attention (:data:`CARRIED_KINDS`); unchanged otherwise."""
        if self.carry and self.needs & CARRIED_KINDS:
            return carry_forward(weights, self.carry)
        return weights

    def choose(
        self, weights: torch.Tensor, k: int, generator: torch.Generator | None
    ) -> torch.Tensor:
        """Pick ``k`` of the candidate ``weights`` (Tensor[C]); returns candidate indices.

        Deterministic top-K; scores may be any finite values (``knorm`` uses negative
        norms). A stable sort keeps the older block on ties.
        """
        return top_k_indices(weights, k)

    def select(
        self,
        evidence: Evidence,
        budget_blocks: int,
        *,
        generator: torch.Generator | None = None,
        state: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Blocks to keep.

        Parameters
        ----------
        evidence : Evidence
            What was gathered for this event: at least what :attr:`needs` names
            (no kind at all for a policy that reads nothing).
        budget_blocks : int
            Blocks allowed; must cover the forced set when ``N`` exceeds it.
        generator : torch.Generator, optional
            CPU generator for the stochastic samplers.
        state : dict, optional
            Caller-owned per-request state (used by ``h2o``).

        Returns
        -------
        LongTensor[min(N, budget_blocks)] (CPU), sorted ascending, unique.

        Raises
        ------
        ValueError
            Evidence lacking what the policy needs, or a budget below the forced set.
        """
        if not isinstance(evidence, Evidence):
            raise TypeError(f"evidence must be an Evidence; got {type(evidence).__name__}")
        check_int("budget_blocks", budget_blocks, low=0)
        missing = self.needs - evidence.holds
        if missing:
            raise ValueError(f"policy {self.name!r} needs {sorted(missing)} in its evidence; "
                             f"it holds {sorted(evidence.holds)}")
        n = evidence.num_blocks
        weights = self.keep_weights(evidence, state)
        if n <= budget_blocks:
            keep = torch.arange(n, dtype=torch.long)
        else:
            forced = forced_blocks(n, self.sink_blocks, self.recent_blocks)
            if forced.numel() > budget_blocks:
                raise ValueError(
                    f"budget_blocks must be >= sink_blocks + recent_blocks + 1 = "
                    f"{forced.numel()} for policy {self.name!r}; got {budget_blocks}"
                )
            is_candidate = torch.ones(n, dtype=torch.bool)
            is_candidate[forced] = False
            candidates = torch.nonzero(is_candidate).flatten()
            picked = self.choose(weights[candidates], budget_blocks - forced.numel(), generator)
            keep = torch.sort(torch.cat([forced, candidates[picked]])).values
        self.after_select(keep, state)
        return keep

    def after_select(self, keep: torch.Tensor, state: dict[str, Any] | None) -> None:
        """Hook for stateful policies to re-index their state to the kept blocks."""


# Evidence whose weight a chosen block carries to its successor (attention that finds a
# fact's key; its value often starts the next block). Key norms do not carry.
CARRIED_KINDS = frozenset({"mass", "expected_attention"})

# name -> class, filled by @register_policy in definition order.
POLICIES: dict[str, type[EvictionPolicy]] = {}
_Policy = TypeVar("_Policy", bound=type[EvictionPolicy])
# Names that mean "no policy" somewhere (config, eval harness) and so cannot be one.
_RESERVED_NAMES = ("none", "dense", "base")


def register_policy(cls: _Policy) -> _Policy:
    """Class decorator: make ``cls`` a method every config, CLI and harness accepts.

    Raises
    ------
    ValueError
        A reserved or already registered name.
    """
    if cls.name in _RESERVED_NAMES or cls.name in POLICIES:
        raise ValueError(f"policy name {cls.name!r} is reserved or already registered")
    POLICIES[cls.name] = cls
    return cls


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
    prefill_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({"indirect": "walk"})
    prompt_end_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType(
        {"direct": "max", "indirect": "none", "sampler": "topk"})
    # In stream every prompt event but the last runs before the question: the window's
    # attention predicts the next tokens, not a later question, so the walk and pps run
    # on query-agnostic evidence too, half expected attention and a key-norm prior (the
    # tuning sets' best; docs/algorithm.md, "The streaming regime").
    stream_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType(
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

    def score(self, evidence: Evidence, state: dict[str, Any] | None) -> torch.Tensor:
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


@register_policy
@dataclass(frozen=True)
class H2OPolicy(EvictionPolicy):
    """Heavy hitters: attention mass accumulated over every event (kept in ``state``)."""

    name: ClassVar[str] = "h2o"
    STATE_KEY: ClassVar[str] = "h2o_cumulative_mass"

    def score(self, evidence: Evidence, state: dict[str, Any] | None) -> torch.Tensor:
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

    def after_select(self, keep: torch.Tensor, state: dict[str, Any] | None) -> None:
        if state is not None and self.STATE_KEY in state:
            state[self.STATE_KEY] = state[self.STATE_KEY][keep]


@register_policy
@dataclass(frozen=True)
class SnapKVPolicy(EvictionPolicy):
    """SnapKV at block level: column sums of the window's attention (no token pooling)."""

    name: ClassVar[str] = "snapkv"

    @property
    def head_needs(self) -> frozenset[str]:
        return frozenset({"mass"})

    def head_score(self, evidence: HeadEvidence) -> torch.Tensor:
        return evidence["mass"]

    def score(self, evidence: Evidence, state: dict[str, Any] | None) -> torch.Tensor:
        return evidence.mass.detach().to("cpu", torch.float64).sum(dim=0)


@register_policy
@dataclass(frozen=True)
class TOVAPolicy(EvictionPolicy):
    """TOVA: the newest query's attention row only."""

    name: ClassVar[str] = "tova"
    query_rows: ClassVar[int | None] = 1

    @property
    def head_needs(self) -> frozenset[str]:
        return frozenset({"mass"})

    def head_score(self, evidence: HeadEvidence) -> torch.Tensor:
        return evidence["mass"]

    def score(self, evidence: Evidence, state: dict[str, Any] | None) -> torch.Tensor:
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

    def score(self, evidence: Evidence, state: dict[str, Any] | None) -> torch.Tensor:
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

    def score(self, evidence: Evidence, state: dict[str, Any] | None) -> torch.Tensor:
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

    @property
    def head_needs(self) -> frozenset[str]:
        return frozenset({"key_norms"})

    def head_score(self, evidence: HeadEvidence) -> torch.Tensor:
        return -evidence["key_norms"]

    def score(self, evidence: Evidence, state: dict[str, Any] | None) -> torch.Tensor:
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

    @property
    def head_needs(self) -> frozenset[str]:
        return frozenset({"expected_attention"})

    def head_score(self, evidence: HeadEvidence) -> torch.Tensor:
        return evidence["expected_attention"]

    def score(self, evidence: Evidence, state: dict[str, Any] | None) -> torch.Tensor:
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

    @property
    def head_needs(self) -> frozenset[str]:
        return frozenset({"reconstruction"})

    def head_score(self, evidence: HeadEvidence) -> torch.Tensor:
        return evidence["reconstruction"]

    def score(self, evidence: Evidence, state: dict[str, Any] | None) -> torch.Tensor:
        raise ValueError("policy 'reconstruction' scores (layer, KV head, token) units only: "
                         "it needs granularity 'head'")


class MethodNames(Sequence[str]):
    """The method names a config accepts, read from :data:`POLICIES` each time: ``"none"``
    (no eviction), then every registered policy's name in registration order. A policy
    registered later, from any module, is in it at once (for ``check_choice``, argparse
    ``choices``, request validation and every method list built from it)."""

    def _names(self) -> tuple[str, ...]:
        return ("none", *POLICIES)

    def __getitem__(self, index: Any) -> Any:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name == "none" or name in POLICIES

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MethodNames):
            other = other._names()
        return self._names() == other if isinstance(other, tuple) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # it changes with the registry

    def __repr__(self) -> str:
        return repr(self._names())


# Every method a config accepts ("none": no eviction). The vLLM plugin serves every one:
# each evidence kind has a worker gatherer.
METHODS = MethodNames()


def head_granular_methods() -> list[str]:
    """The registered policies with a per-head score (``granularity: head``), sorted."""
    return sorted(m for m, cls in POLICIES.items() if cls().head_needs)


def get_policy(name: str, **knobs: Any) -> EvictionPolicy:
    """Build a policy by name with validated knobs.

    Raises
    ------
    ValueError
        Unknown policy name, unknown knob, or a knob out of range.
    """
    check_choice("policy", name, POLICIES)
    cls = POLICIES[name]
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(knobs) - allowed)
    if unknown:
        raise ConfigError(
            unknown[0],
            f"unknown knob(s) {unknown} for policy {name!r}; allowed: {sorted(allowed)}",
        )
    return cls(**knobs)
