"""The candidates for the prompt-end event on chat-shaped prompts
(:mod:`nexus_vllm.eval.candidates` runs them): what one candidate is
(:class:`Candidate`), and :data:`SETS`, the sets ``scripts/chat_shape_candidates.py``
sweeps (docs/algorithm.md, "The chat shape")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["HEADS", "ROWS", "ROWS_REDUCES", "SETS", "Candidate", "CandidateSet"]

ROWS = ("last", "question", "answer")
HEADS = ("mean", "max", "union")
# How a block's rows become its score: core's direct modes, and readings built on them.
ROWS_REDUCES = ("mean", "max", "max of normalized", "top 2", "max + mean")


@dataclass(frozen=True)
class Candidate:
    """One way of running the prompt-end event.

    Attributes
    ----------
    name : str
        Its row in the table.
    rows : {"last", "question", "answer"}
        The query rows that score: the prompt's newest ``window``, the question's own
        words (without the template's markup), or the first ``defer`` answer tokens.
    window : int
        Rows under ``last``.
    heads : {"mean", "max", "union"}
        How heads and layers combine: the config's ``attention_reduce`` (``mean``, ``max``), or
        each head nominating its best blocks in turn (the ``union`` of TensorRT-LLM's
        KV-cache compression).
    carry : int
        Each block's weight raised to its predecessors' (:func:`carry_forward`).
    defer : int
        Answer tokens decoded before the event (the prompt is held that many decode
        steps longer).
    graded : float
        > 0: a prompt-end event down to ``graded`` x the budget first (the prompt's last
        32 rows, read as the candidate reads them), then the deferred one to the budget.
    knorm : bool
        Key norms, which need no query, instead of attention.
    rows_reduce : str
        How a block's rows become its score (:data:`ROWS_REDUCES`): ``mean`` of each
        row's normalised mass, ``max`` (each block's best share as softmax gave it),
        ``max of normalized`` (the best share of each row renormalised after the maximum
        over heads and layers), ``top 2`` (the sum of a block's two best shares), ``max +
        mean`` (the best share's and the mean's scores, each summing to 1, added).
    recent : int
        The config's ``recent_blocks`` (forced newest full blocks).
    oracle : bool
        An upper bound, not a policy: the blocks holding each reference answer's sentence
        (the answer and the :data:`ORACLE_LEAD` tokens before it) are kept first, then
        the candidate's weights fill the budget.
    carry_back : float
        > 0: each block also raised to this share of the next block's weight (the
        sentence that a found block ends may begin in the block before it).
    """

    name: str
    rows: str = "last"
    window: int = 32
    heads: str = "mean"
    carry: int = 0
    defer: int = 0
    graded: float = 0.0
    knorm: bool = False
    rows_reduce: str = "mean"
    recent: int = 4
    oracle: bool = False
    carry_back: float = 0.0

    def __post_init__(self) -> None:
        for knob, value, choices in (("rows", self.rows, ROWS), ("heads", self.heads, HEADS),
                                     ("rows_reduce", self.rows_reduce, ROWS_REDUCES)):
            if value not in choices:
                raise ValueError(f"{knob} must be one of {choices}; got {value!r}")
        if self.rows == "answer" and self.defer < 1:
            raise ValueError("rows 'answer' scores the deferred answer's rows: set defer >= 1")


@dataclass(frozen=True)
class CandidateSet:
    """Candidates run side by side, and the one the others are paired against."""

    candidates: tuple[Candidate, ...]
    reference: str

    def __post_init__(self) -> None:
        if self.reference not in {c.name for c in self.candidates}:
            raise ValueError(f"reference {self.reference!r} is none of the set's candidates")




def _best(name: str, **changes: Any) -> Candidate:
    """Each block's best share (heads and rows), carry 1, 2 recent blocks; ``changes``."""
    return replace(Candidate(name, heads="max", rows_reduce="max", carry=1, recent=2),
                   **changes)


_ORACLE = _best("oracle: the answers' sentences first, then the best share", oracle=True)
SETS: Mapping[str, CandidateSet] = {
    # Which rows score, how heads and layers combine, carry, deferral, key norms.
    "first": CandidateSet((
        Candidate("shipped end (last 32 rows, mean)"),
        Candidate("question rows, mean", rows="question"),
        Candidate("newest row (TOVA), mean", window=1),
        Candidate("union of heads, question rows", rows="question", heads="union"),
        Candidate("max over heads", heads="max"),
        Candidate("carry 1, mean", carry=1),
        Candidate("max over heads + carry 1", heads="max", carry=1),
        Candidate("max + carry 1, question rows", rows="question", heads="max", carry=1),
        Candidate("max + carry 1, newest row", window=1, heads="max", carry=1),
        Candidate("max + carry 1, 64 rows", window=64, heads="max", carry=1),
        Candidate("defer 8, answer rows, mean", rows="answer", defer=8),
        Candidate("defer 8, answer rows, max + carry 1", rows="answer", defer=8, heads="max",
                  carry=1),
        Candidate("defer 16, answer rows, mean", rows="answer", defer=16),
        Candidate("graded 2x, defer 8, mean", rows="answer", defer=8, graded=2.0),
        Candidate("defer 12, answer rows, max + carry 1", rows="answer", defer=12,
                  heads="max", carry=1),
        Candidate("graded 2x, defer 16 (the first decode event), max + carry 1",
                  rows="answer", defer=16, graded=2.0, heads="max", carry=1),
        Candidate("key norms (knorm)", knorm=True),
    ), reference="max over heads + carry 1"),
    # Each block's best row instead of the rows' mean, and fewer forced recent blocks.
    "second": CandidateSet((
        Candidate("max over heads + carry 1", heads="max", carry=1),
        Candidate("max over heads and rows + carry 1", heads="max", rows_reduce="max",
                  carry=1),
        Candidate("max + carry 1, 2 recent blocks", heads="max", carry=1, recent=2),
        Candidate("max + carry 1, 1 recent block", heads="max", carry=1, recent=1),
        Candidate("max over heads and rows + carry 1, 2 recent blocks", heads="max",
                  rows_reduce="max", carry=1, recent=2),
        Candidate("max over heads and rows + carry 1, 1 recent block", heads="max",
                  rows_reduce="max", carry=1, recent=1),
        Candidate("max over heads and rows + carry 1, question rows", rows="question",
                  heads="max", rows_reduce="max", carry=1),
    ), reference="max over heads and rows + carry 1, 2 recent blocks"),
    # The best row over the rows as softmax gives them, or over rows renormalised after
    # the maximum over heads and layers.
    "normalized": CandidateSet((
        Candidate("max over heads and rows + carry 1, 2 recent blocks", heads="max",
                  rows_reduce="max", carry=1, recent=2),
        Candidate("max over heads, rows renormalised, max over rows + carry 1, 2 recent "
                  "blocks", heads="max", rows_reduce="max of normalized", carry=1, recent=2),
    ), reference="max over heads and rows + carry 1, 2 recent blocks"),
    # Around the best share: the rows it reads, carry, and two ways between the best
    # share and the mean.
    "fourth": CandidateSet((
        _best("best share (shipped)"),
        _best("best share, the question's rows", rows="question"),
        _best("best share, 16 rows", window=16),
        _best("best share, 64 rows", window=64),
        _best("best share, no carry", carry=0),
        _best("two best shares", rows_reduce="top 2"),
        _best("best share + rows' mean", rows_reduce="max + mean"),
    ), reference="best share (shipped)"),
    # The ceiling: what a choice of blocks that knew where the answers are keeps (needle
    # tasks, whose references are in the prompt).
    "oracle": CandidateSet((_best("best share (shipped)"), _ORACLE),
                           reference="best share (shipped)"),
    # Weight carried back to the block before a found one, beside the oracle.
    "fifth": CandidateSet((
        _best("best share (shipped)"),
        _best("best share, carry back 1", carry_back=1.0),
        _best("best share, carry back at half weight", carry_back=0.5),
        _ORACLE,
    ), reference="best share (shipped)"),
}
