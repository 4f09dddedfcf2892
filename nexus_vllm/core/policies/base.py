"""The base of every eviction policy: the forced set, carry, :class:`EvictionPolicy` and
the registry (:data:`POLICIES`, :func:`register_policy`, :data:`METHODS`,
:func:`get_policy`).

The knobs every policy shares (the forced set and carry) have their defaults and their
rules here and nowhere else (:data:`SHARED_KNOBS`, :func:`check_shared_knobs`):
:class:`~nexus_vllm.core.EvictionConfig` reads both, so a policy built by name alone is
the one a server runs.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import ClassVar, TypeVar, overload

import torch

from .._validate import ConfigError, check_choice, check_int
from ..evidence import Evidence, carried_kinds
from ..head_paged import HeadEvidence
from ..sampling import top_k_indices

__all__ = ["METHODS", "POLICIES", "SHARED_KNOBS", "EvictionPolicy", "MethodNames",
           "PolicyState", "carry_forward", "check_shared_knobs", "forced_blocks", "forced_count",
           "forced_tail", "get_policy", "head_granular_methods", "knob_owners", "knob_refusal",
           "no_head_score", "register_policy"]

# The knobs every policy takes besides its own, and their defaults: the forced set (one
# sink block, the two newest full blocks, the current block) and one block of carry.
SHARED_KNOBS: Mapping[str, int] = MappingProxyType(
    {"sink_blocks": 1, "recent_blocks": 2, "carry": 1})
# The caller-owned per-request state a policy keeps between events (H2O's cumulative
# mass), keyed by the policy's own names.
PolicyState = dict[str, torch.Tensor]


def check_shared_knobs(sink_blocks: object, recent_blocks: object, carry: object) -> None:
    """The rules of :data:`SHARED_KNOBS`: ``sink_blocks`` >= 1, ``recent_blocks`` >= 0,
    ``carry`` in 0..4 (:class:`~nexus_vllm.core.ConfigError` naming the knob)."""
    check_int("sink_blocks", sink_blocks, low=1)
    check_int("recent_blocks", recent_blocks, low=0)
    check_int("carry", carry, low=0, high=4)


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

    The defaults are :data:`SHARED_KNOBS`, the config's: a policy built by name alone is
    the one a server runs.
    """

    sink_blocks: int = SHARED_KNOBS["sink_blocks"]
    recent_blocks: int = SHARED_KNOBS["recent_blocks"]
    carry: int = SHARED_KNOBS["carry"]

    name: ClassVar[str] = "base"
    # Knob overrides at prefill events (after a prompt chunk, and the prompt-end event):
    # in prompt_mode "stream" and "keep", and in "end". A config's own prefill_args win.
    prefill_defaults: ClassVar[Mapping[str, object]] = MappingProxyType({})
    prompt_end_defaults: ClassVar[Mapping[str, object]] = MappingProxyType({})
    # Knob defaults at every event (decode included) in prompt_mode "stream", where every
    # prompt event but the last runs before the question is seen; a config's policy_args
    # win, and prefill events apply prefill_defaults over them.
    stream_defaults: ClassVar[Mapping[str, object]] = MappingProxyType({})
    # The evidence kinds score() reads (:mod:`nexus_vllm.core.evidence`); empty for
    # score-free policies.
    evidence: ClassVar[frozenset[str]] = frozenset({"mass"})
    # Newest rows of the window's mass that score() reads (None: all of them).
    query_rows: ClassVar[int | None] = None
    # A policy whose score exists per (layer, KV head, token) only: granularity "head".
    head_only: ClassVar[bool] = False
    # The one per-head evidence kind (:data:`~nexus_vllm.core.head_paged.HEAD_KINDS`)
    # whose value is the policy's per-head score as it is (None: no such kind; a policy
    # with a per-head score of its own overrides :attr:`head_needs` and :meth:`head_score`).
    head_kind: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        check_shared_knobs(self.sink_blocks, self.recent_blocks, self.carry)

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

    def score(self, evidence: Evidence, state: PolicyState | None) -> torch.Tensor:
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
        at ``granularity`` ``head``. By default :attr:`head_kind`, if any."""
        return frozenset() if self.head_kind is None else frozenset({self.head_kind})

    @property
    def head_sampler(self) -> str:
        """How head granularity picks units past the forced set (one threshold: topk)."""
        return "topk"

    def head_score(self, evidence: HeadEvidence) -> torch.Tensor:
        """Keep weight of every (layer, KV head, token) unit, Tensor[L, Hkv, T]; one
        threshold over all of them spends the budget (:mod:`~nexus_vllm.core.head_paged`).
        By default the evidence of :attr:`head_kind`."""
        if self.head_kind is not None:
            return evidence[self.head_kind]
        raise ValueError(f"policy {self.name!r} has no per-head score: granularity 'head' "
                         f"takes {', '.join(head_granular_methods())}")

    def reweight(self, weights: torch.Tensor, evidence: Evidence) -> torch.Tensor:
        """Factors that belong to each block itself, applied after ``carry`` (the
        identity here; Nexus's key-norm prior). ``weights`` is Tensor[N] float64 (CPU);
        returns Tensor[N]."""
        return weights

    def keep_weights(self, evidence: Evidence, state: PolicyState | None) -> torch.Tensor:
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
        attention (a kind whose :attr:`EvidenceKind.carries`); unchanged otherwise."""
        if self.carry and self.needs & carried_kinds():
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
        state: PolicyState | None = None,
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

    def after_select(self, keep: torch.Tensor, state: PolicyState | None) -> None:
        """Hook for stateful policies to re-index their state to the kept blocks."""



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



class MethodNames(Sequence[str]):
    """The method names a config accepts, read from :data:`POLICIES` each time: ``"none"``
    (no eviction), then every registered policy's name in registration order. A policy
    registered later, from any module, is in it at once (for ``check_choice``, argparse
    ``choices``, request validation and every method list built from it)."""

    def _names(self) -> tuple[str, ...]:
        return ("none", *POLICIES)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...

    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
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


def knob_owners(knob: str) -> list[str]:
    """The registered policies that take ``knob``."""
    return [name for name, cls in POLICIES.items() if knob in cls.knobs()]


def no_head_score(policy: EvictionPolicy) -> str:
    """Why ``policy`` cannot run at ``granularity: head``."""
    return (f"granularity 'head' needs a policy with a per-head score; {policy.name!r} has "
            f"none (with one: {', '.join(head_granular_methods())})")


def knob_refusal(knob: str, method: str) -> str:
    """Why ``knob`` is refused for ``method``: whose knob it is, or a close match."""
    takes = POLICIES[method].knobs()
    its = f"its knobs: {', '.join(takes)}" if takes else "it takes no knobs"
    owners = knob_owners(knob)
    if owners:
        whose = ", ".join(repr(o) for o in owners)
        return f"a knob of policy {whose}, not of method {method!r} ({its})"
    match = difflib.get_close_matches(knob, takes, n=1)
    hint = f" (did you mean {match[0]!r}?)" if match else ""
    return f"not a knob of policy {method!r}{hint}; {its}"


def get_policy(name: str, **knobs: object) -> EvictionPolicy:
    """Build a policy by name with validated knobs.

    Raises
    ------
    ValueError
        Unknown policy name, unknown knob, or a knob out of range.
    """
    check_choice("policy", name, POLICIES)
    cls = POLICIES[name]
    # Called with the knobs as given: the policy's __post_init__ checks their values.
    build: Callable[..., EvictionPolicy] = cls
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(knobs) - allowed)
    if unknown:
        raise ConfigError(
            unknown[0],
            f"unknown knob(s) {unknown} for policy {name!r}; allowed: {sorted(allowed)}",
        )
    return build(**knobs)
