"""The evidence registry: what a policy may read at an event, one kind per module.

A kind of evidence (:class:`EvidenceKind`) declares everything the rest of the system needs
to know about it, so that adding one touches nothing else:

* its ``name`` (the vocabulary of ``EvictionPolicy.needs``) and per-block ``layout``:
  ``"rows"`` (one row per window query, ``[W, N]``) or ``"blocks"`` (one value per block,
  ``[N]``);
* how its per-rank partial results combine over tensor-parallel ranks and pipeline stages
  (:meth:`EvidenceKind.rank_reduce`: a sum of shares, or a maximum);
* its transformers-path gatherer (:meth:`EvidenceKind.gather_dense`, on one sequence's
  contiguous keys) and its vLLM worker gatherer (:meth:`EvidenceKind.gather_paged`, on a
  batch of requests read through their block tables), both on plain tensors (no vLLM or
  transformers import), checked in tests against a reference in the same module;
* how the reduced values become what a policy reads (:meth:`EvidenceKind.finish`).

The worker lays out its wire vector, reduces it and unpacks it segment by segment as the
registry says; the scheduler and the transformers path build :class:`Evidence` with
:meth:`Evidence.from_gathered`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from .._validate import check_mass
from ..rotary import Rotary

__all__ = [
    "EVIDENCE_KINDS",
    "DenseLayer",
    "DenseSequence",
    "Evidence",
    "EvidenceKind",
    "PagedBatch",
    "carried_kinds",
    "evidence_kind",
    "register_evidence",
]

# Rows of a mass matrix must sum to 1 within this (float32 sums over thousands of blocks,
# averaged over heads and layers, drift by far less).
ROW_SUM_TOLERANCE = 1e-3


@dataclass(frozen=True)
class DenseLayer:
    """One scored layer of one sequence on the transformers path.

    Attributes
    ----------
    queries : Tensor[W, Hq, D]
        The newest W query rows (post-RoPE).
    keys : Tensor[T, Hkv, D]
        The sequence's cached keys (post-RoPE), in cache order.
    """

    queries: torch.Tensor
    keys: torch.Tensor


@dataclass(frozen=True)
class DenseSequence:
    """What a dense gatherer reads for one sequence.

    Attributes
    ----------
    layers : list of DenseLayer
        The scored layers.
    block_size : int
    attention_reduce : {"mean", "max"}
    query_positions : LongTensor[W]
        Logical position of each query row.
    next_position : int
        Tokens seen (the position of the next token).
    rotary : Rotary or None
        The model's rotary embedding (kinds that un-rotate queries need it).
    """

    layers: list[DenseLayer]
    block_size: int
    attention_reduce: str
    query_positions: torch.Tensor
    next_position: int
    rotary: Rotary | None = None


@dataclass(frozen=True)
class PagedBatch:
    """What a worker gatherer reads for the R requests due in one step.

    Attributes
    ----------
    queries : Tensor[L, R, W, Hq, D]
        Each request's newest W query rows per scored layer (post-RoPE; a request with
        fewer rows has its oldest rows padded, see ``rows``).
    rows : LongTensor[R]
        Valid (newest) rows of each request, ``1 <= rows <= W``.
    query_positions : LongTensor[R, W]
        Logical position of each row.
    next_positions : LongTensor[R]
        Tokens of each request after this step.
    key_caches : list of Tensor[num_blocks, Hkv, block_size, D]
        The scored layers' key caches (this rank's KV heads).
    tables : IntTensor[R, N_max]
        Block tables as attention reads them (evicted blocks compacted out).
    seq_lens : IntTensor[R]
        Tokens attention reads per request (live ones).
    attention_reduce : {"mean", "max"}
    layers_divisor : int
        Scored layers of the whole model x TP ranks: a kind whose ranks sum shares divides
        by it, so the sum over every rank of every stage is the mean over the model.
    paged_mass : callable, optional
        The paged block-mass kernel the ``mass`` kind runs over every scored layer
        (``nexus_vllm.kernels.block_attention_mass_paged_layers`` with its backend bound):
        the worker hands it in, so this reference package imports no kernel.
    rotary : Rotary or None
    """

    queries: torch.Tensor
    rows: torch.Tensor
    query_positions: torch.Tensor
    next_positions: torch.Tensor
    key_caches: list[torch.Tensor]
    tables: torch.Tensor
    seq_lens: torch.Tensor
    attention_reduce: str
    layers_divisor: int
    paged_mass: Callable[..., object] | None = None
    rotary: Rotary | None = None


class EvidenceKind:
    """One kind of evidence; subclass, set the class attributes, register an instance.

    Attributes
    ----------
    name : str
    layout : {"rows", "blocks"}
        ``rows``: ``[W, N]``, one row per window query; ``blocks``: ``[N]``.
    reads_queries : bool
        The gatherers read the window's query rows (the worker skips a request whose
        window it did not capture).
    needs_rotary : bool
        The gatherers un-rotate queries (a server refuses such a policy for a model
        without a rotary table).
    carries : bool
        A chosen block's weight from this kind carries to its successor (attention that
        finds a fact's key: its value often starts the next block); a policy reading it
        applies its ``carry`` (:func:`~nexus_vllm.core.policies.carry_forward`). Key
        norms, a block's own prior, do not carry.
    """

    name: ClassVar[str] = ""
    layout: ClassVar[str] = "blocks"
    reads_queries: ClassVar[bool] = False
    needs_rotary: ClassVar[bool] = False
    carries: ClassVar[bool] = False

    def rank_reduce(self, attention_reduce: str) -> str:
        """``"sum"`` (each rank's share of a mean) or ``"max"`` over TP ranks and stages."""
        return "sum"

    def gather_dense(self, seq: DenseSequence) -> torch.Tensor:
        """This kind for one sequence: ``[W, N]`` or ``[N]`` (float32)."""
        raise NotImplementedError

    def gather_paged(self, batch: PagedBatch, out: torch.Tensor) -> None:
        """This rank's part for the batch into ``out`` (``[R, W, N_max]`` or
        ``[R, N_max]``, zeros on entry): reduced over the rank's heads and layers so that
        :meth:`rank_reduce` over every rank gives the dense value."""
        raise NotImplementedError

    def finish(self, raw: torch.Tensor, attention_reduce: str) -> dict[str, torch.Tensor]:
        """What a policy reads from the reduced values: ``{name: tensor}`` plus any
        companion (the mass's ``row_scale``)."""
        return {self.name: raw.float()}

    def validate(self, value: torch.Tensor, num_blocks: int) -> None:
        """Raise ValueError unless ``value`` is this kind's shape for ``num_blocks``."""
        want = (f"[W, {num_blocks}] finite values, one row per query" if self.layout == "rows"
                else f"{num_blocks} finite values, one per block (Tensor[{num_blocks}])")
        ok = isinstance(value, torch.Tensor) and (
            value.dim() == 2 and value.shape[1] == num_blocks if self.layout == "rows"
            else tuple(value.shape) == (num_blocks,))
        if not ok or not bool(torch.isfinite(value).all()):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
            raise ValueError(f"{self.name} must be {want}; got {shape}")


# name -> kind, filled by register_evidence in definition order.
EVIDENCE_KINDS: dict[str, EvidenceKind] = {}


def register_evidence(kind: EvidenceKind) -> EvidenceKind:
    """Make ``kind`` one every policy, scorer and gatherer knows (unique name)."""
    if not kind.name or kind.name in EVIDENCE_KINDS:
        raise ValueError(f"evidence kind name {kind.name!r} is empty or already registered")
    if kind.layout not in ("rows", "blocks"):
        raise ValueError(f"evidence kind {kind.name!r}: layout must be 'rows' or 'blocks'")
    EVIDENCE_KINDS[kind.name] = kind
    return kind


def carried_kinds() -> frozenset[str]:
    """The registered kinds whose weight carries to the next block
    (:attr:`EvidenceKind.carries`)."""
    return frozenset(name for name, kind in EVIDENCE_KINDS.items() if kind.carries)


def evidence_kind(name: str) -> EvidenceKind:
    """The registered kind ``name`` (ValueError naming the known ones otherwise)."""
    kind = EVIDENCE_KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown evidence kind {name!r}; known: {sorted(EVIDENCE_KINDS)}")
    return kind


class Evidence(Mapping[str, torch.Tensor]):
    """What a policy may read at one event of one request: a validated mapping from
    evidence kind to tensor over the N live blocks (in logical order).

    Parameters
    ----------
    mass : Tensor[W, N], optional
        Block attention mass of the newest window queries; each row sums to 1 (a row of
        zeros, a query that saw nothing, is allowed).
    key_norms : Tensor[N], optional
        Mean key norm per live block.
    row_scale : Tensor[W], optional
        Each mass row's total as scored, before it was renormalised into ``mass``: under
        ``attention_reduce: max`` a row of maxima over heads and layers sums to 1 or more, and
        ``mass * row_scale[:, None]`` gives back each block's largest softmax share
        (:meth:`from_gathered`). None: the rows were distributions as scored.
    num_blocks : int, optional
        N, required when no kind is given (a policy that reads nothing).
    **kinds : Tensor
        Every other registered kind, by name (``expected_attention=...``).

    Raises
    ------
    ValueError
        An unknown kind, a kind not of its shape for N, ``mass`` with a row not summing
        to 1, or ``row_scale`` not W finite values >= 0 (or without ``mass``).
    """

    def __init__(self, mass: torch.Tensor | None = None, key_norms: torch.Tensor | None = None,
                 *, row_scale: torch.Tensor | None = None, num_blocks: int | None = None,
                 **kinds: torch.Tensor) -> None:
        values = {name: value for name, value in
                  (("mass", mass), ("key_norms", key_norms), *kinds.items())
                  if value is not None}
        if num_blocks is None:
            if mass is not None:
                num_blocks = int(mass.shape[-1]) if mass.dim() else 0
            elif values:
                num_blocks = int(next(iter(values.values())).shape[-1])
            else:
                raise ValueError("Evidence without any kind needs num_blocks")
        self._num_blocks = int(num_blocks)
        for name, value in values.items():
            kind = evidence_kind(name)
            if name == "mass":
                check_mass(value, row_sum_tolerance=ROW_SUM_TOLERANCE)
            kind.validate(value, self._num_blocks)
        if row_scale is not None:
            if mass is None:
                raise ValueError("row_scale describes mass rows; got no mass")
            w = int(mass.shape[0])
            if tuple(row_scale.shape) != (w,) or not bool(torch.isfinite(row_scale).all()):
                raise ValueError(f"row_scale must be {w} finite values, one per row "
                                 f"(Tensor[{w}]); got {tuple(row_scale.shape)}")
            if bool((row_scale < 0).any()):
                raise ValueError("row_scale must be >= 0")
        self._values = values
        self.row_scale = row_scale

    @classmethod
    def from_gathered(cls, gathered: Mapping[str, torch.Tensor], *, attention_reduce: str,
                      num_blocks: int | None = None) -> Evidence:
        """Evidence from gathered and reduced values by kind (each kind's
        :meth:`EvidenceKind.finish`: the mass rows renormalised under ``max``)."""
        parts: dict[str, torch.Tensor] = {}
        for name, raw in gathered.items():
            parts.update(evidence_kind(name).finish(raw, attention_reduce))
        return cls(num_blocks=num_blocks, **parts)

    # -- the mapping ----------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._values[name]
        except KeyError:
            raise KeyError(f"this evidence holds no {name!r} (it holds "
                           f"{sorted(self._values)})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self._values.items()}
        return f"Evidence(num_blocks={self._num_blocks}, {shapes})"

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def holds(self) -> frozenset[str]:
        """The kinds present, in the vocabulary of ``EvictionPolicy.needs``."""
        return frozenset(self._values)

    @property
    def mass(self) -> torch.Tensor:
        return self["mass"]

    @property
    def key_norms(self) -> torch.Tensor | None:
        return self._values.get("key_norms")
