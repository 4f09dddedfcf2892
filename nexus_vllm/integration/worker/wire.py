"""The wire vector of one scored step: its layout per evidence kind, and its reduction
over tensor-parallel ranks and pipeline stages.

Each evidence kind a due request reads gets one segment of a flat float vector, laid out
as the registry (:mod:`nexus_vllm.core.evidence`) says: the kinds reduced by their
maximum over ranks first, then those summed, then a validity flag. The scorer
(``block_scorer.py``) fills it; this module says where each kind lives and how ranks and
stages combine it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nexus_vllm.core import EVIDENCE_KINDS, evidence_kind

__all__ = ["Due", "RankLayout", "Reduce", "Segment", "StageLinks", "add_stage_parts",
           "reduce_over_tp", "wire_layout"]

@dataclass(frozen=True)
class RankLayout:
    """Where one worker sits in its engine's tensor- x pipeline-parallel grid.

    Attributes
    ----------
    tp_rank, tp_size : int
        Tensor-parallel rank and size (each rank holds some query and KV heads).
    pp_rank, pp_size : int
        Pipeline stage and number of stages (each stage holds some decoder layers).
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        for name, rank, size in (("tp", self.tp_rank, self.tp_size),
                                 ("pp", self.pp_rank, self.pp_size)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name}_rank {rank} is not in [0, {name}_size={size})")

    @property
    def world(self) -> int:
        """Ranks that score each step (every TP rank of every stage)."""
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        """vLLM's rank order inside one engine: stage-major, TP rank within a stage."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_output(self) -> bool:
        """TP rank 0 of the last stage: the worker whose output vLLM's executors read."""
        return self.tp_rank == 0 and self.pp_rank == self.pp_size - 1


# (tensor, op) -> the tensor reduced over a group, out of place; op is "sum" or "max".
Reduce = Callable[[torch.Tensor, str], torch.Tensor]


class StageLinks(Protocol):
    """Point-to-point links from each pipeline stage to the last one
    (``vllm_compat.StageLink`` in a server)."""

    def send_to_last(self, t: torch.Tensor) -> Any:
        """Start sending ``t`` to the last stage; a work handle (``is_completed``,
        ``wait``)."""

    def receive_from(self, stage: int, out: torch.Tensor) -> Any:
        """Start receiving stage ``stage``'s tensor into ``out``; a work handle."""


def reduce_over_tp(flat: torch.Tensor, tp_size: int, tp_reduce: Reduce, *,
                   max_prefix: int = 0) -> torch.Tensor:
    """Sum ``flat`` over the TP ranks of this stage (out of place); its first
    ``max_prefix`` values are reduced by their maximum instead.

    Every TP rank must call this for the same steps with the same shape, failed or not.
    Each rank holds some heads, so a sum of each rank's share is the mean over the
    stage's heads, and a maximum of each rank's maximum its maximum (``attention_reduce:
    max``).

    Parameters
    ----------
    flat : Tensor [n] float32
        This rank's masses, key norms and validity flag (see ``PendingScores``).
    tp_size : int
    tp_reduce : callable
        ``(tensor, op)``: reduce over the TP group (vLLM's in a server).
    max_prefix : int
        Leading values reduced by ``max`` (the masses under ``attention_reduce: max``); the
        rest (key norms, the flag) are summed.
    """
    if tp_size == 1:
        return flat
    if max_prefix:
        return torch.cat([tp_reduce(flat[:max_prefix], "max"),
                          tp_reduce(flat[max_prefix:], "sum")])
    return tp_reduce(flat, "sum")


def add_stage_parts(flat: torch.Tensor, parts: list[torch.Tensor], *,
                    max_prefix: int = 0) -> torch.Tensor:
    """The last stage's ``flat`` combined with the other stages' ``parts`` (each stage's
    sum over its TP ranks): summed, the first ``max_prefix`` values by their maximum.
    Each stage holds some layers, so this is the model's mean (or maximum) over every
    scored layer, and the flag counts every rank that scored."""
    out = flat.clone()
    for part in parts:
        out[max_prefix:] += part[max_prefix:]
        if max_prefix:
            torch.maximum(out[:max_prefix], part[:max_prefix], out=out[:max_prefix])
    return out


@dataclass(frozen=True)
class Due:
    """One request to score this step."""

    row: int  # batch row
    req_id: str
    window: int  # query rows (0: its kinds read no query)
    live: int  # live blocks
    kinds: frozenset[str]  # the evidence kinds its policy reads


@dataclass(frozen=True)
class Segment:
    """One evidence kind's part of the wire vector: ``[len(due), rows, cols]`` for a
    ``rows`` kind, ``[len(due), cols]`` for a ``blocks`` kind, from ``offset``."""

    kind: str
    due: tuple[Due, ...]
    rows: int  # W_s (1 for a blocks kind)
    cols: int  # N_max
    offset: int

    @property
    def size(self) -> int:
        return len(self.due) * self.rows * self.cols

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        part = flat[self.offset:self.offset + self.size]
        if evidence_kind(self.kind).layout == "rows":
            return part.view(len(self.due), self.rows, self.cols)
        return part.view(len(self.due), self.cols)


def wire_layout(due: list[Due], attention_reduce: str) -> tuple[list[Segment], int]:
    """The segments of one step's wire vector, and where its maximum-reduced prefix ends:
    one per evidence kind any due request reads, in registry order, those reduced by
    their maximum over ranks first (``EvidenceKind.rank_reduce``)."""
    n_max = max((d.live for d in due), default=0)
    kinds = [k for k in EVIDENCE_KINDS if any(k in d.kinds for d in due)]
    kinds.sort(key=lambda k: evidence_kind(k).rank_reduce(attention_reduce) != "max")
    segments: list[Segment] = []
    offset = max_prefix = 0
    for name in kinds:
        kind_due = tuple(d for d in due if name in d.kinds)
        rows = max(d.window for d in kind_due) if evidence_kind(name).layout == "rows" else 1
        seg = Segment(name, kind_due, rows, n_max, offset)
        segments.append(seg)
        offset += seg.size
        if evidence_kind(name).rank_reduce(attention_reduce) == "max":
            max_prefix = offset
    return segments, max_prefix
