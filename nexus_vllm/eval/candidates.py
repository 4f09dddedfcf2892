"""Candidates for the prompt-end event on chat-shaped prompts, on the transformers path.

A chat-shaped prompt (:mod:`nexus_vllm.eval.tasks`, protocol ``chat``: instruction,
document and question in one user message, the chat template up to the assistant's
header, no answer prefix) is prefilled once, uncompressed (:func:`dense_states`); every
:class:`Candidate` then runs its eviction on a copy of that state, down to a 20% budget
(of the tokens seen when it fires), and decodes greedily with the shipped decode events
(:func:`run_candidate`).

A candidate's block weights (:func:`candidate_weights`) are core's evidence and scores:
the window's mass combined over heads and layers by ``attention_reduce``
(:meth:`~nexus_vllm.hf.streaming.StreamingSession.block_mass`), its rows read by
:func:`~nexus_vllm.core.direct_scores`, carried by
:func:`~nexus_vllm.core.carry_forward`; a few candidates add a reading core does not ship
(heads nominating blocks in turn, a block's two best shares, weight carried back, an
oracle). The blocks kept are the forced set plus the top-K of the rest by those weights,
chosen by an :class:`~nexus_vllm.core.EvictionPolicy`'s ``select`` as the prompt-end
event chooses them.

:data:`SETS` are the candidate sets that ``scripts/chat_shape_candidates.py`` sweeps
(docs/algorithm.md, "The chat shape").
"""

from __future__ import annotations

import copy
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

import torch

from nexus_vllm.core import (
    EvictionConfig,
    EvictionPolicy,
    EvictionTrigger,
    Evidence,
    block_attention_mass,
    carry_forward,
    cdiv,
    direct_scores,
    forced_blocks,
    normalize_rows,
)
from nexus_vllm.core.budget import budget_blocks
from nexus_vllm.eval.candidate_sets import (
    HEADS,
    ROWS,
    ROWS_REDUCES,
    SETS,
    Candidate,
    CandidateSet,
)
from nexus_vllm.eval.oracle import ORACLE_LEAD
from nexus_vllm.hf.generate import greedy_ids
from nexus_vllm.hf.streaming import StreamingSession

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["BUDGET_RATIO", "CAPTURE_ROWS", "HEADS", "ORACLE_LEAD", "ROWS", "ROWS_REDUCES",
           "SETS", "AnswerRanks", "Candidate", "CandidateSet", "ChatPrompt", "GivenWeights",
           "answer_ranks", "candidate_config", "candidate_weights", "chat_prompt", "chat_prompts",
           "dense_states", "evict_to", "greedy", "per_head_mass", "run_candidate"]

# The budget every candidate evicts to: a share of the tokens seen when it fires.
BUDGET_RATIO = 0.2
# Query rows the dense prefill keeps: the widest window, or the question plus the
# deferred answer.
CAPTURE_ROWS = 160
# Blocks of the oracle's answer spans: the default block size, which every candidate keeps.
_BLOCK = EvictionConfig.block_size

@dataclass
class ChatPrompt:
    """One chat-shaped request and what the candidates share of it.

    Attributes
    ----------
    ids : LongTensor[T]
    question : (int, int)
        Token range of the question's own words.
    score : callable
        The generated text's score.
    max_new_tokens : int
    answer_blocks : tuple of int
        Blocks holding a reference answer's sentence (the oracle's).
    dense_states : dict
        Answer tokens decoded -> (dense session, next logits, tokens generated), filled
        by :func:`dense_states`.
    """

    ids: torch.Tensor
    question: tuple[int, int]
    score: Callable[[str], float]
    max_new_tokens: int
    answer_blocks: tuple[int, ...] = ()
    dense_states: dict[int, tuple[StreamingSession, torch.Tensor, list[int]]] = field(
        default_factory=dict)


def chat_prompts(task: str, index: int, seed: int, tokenizer: PreTrainedTokenizerBase,
                 context: int) -> list[ChatPrompt]:
    """The chat-shaped requests of a sample: one, or one per turn of a conversation."""
    from nexus_vllm.eval.dialogues import DIALOGUE_TASKS, make_dialogue
    from nexus_vllm.eval.tasks import make_sample

    if task in DIALOGUE_TASKS:
        d = make_dialogue(task, seed=seed, index=index, target_tokens=context,
                          tokenizer=tokenizer)
        return [chat_prompt(str(tokenizer.decode(list(d.ids[:t.probe.prompt_end]))), tokenizer,
                            functools.partial(d.score, i), t.probe.max_new_tokens, t.answers)
                for i, t in enumerate(d.turns)]
    s = make_sample(task, seed=seed, index=index, target_tokens=context, tokenizer=tokenizer,
                    protocol="chat")
    return [chat_prompt(s.preamble + s.context + s.question, tokenizer, s.score,
                        s.max_new_tokens, s.answers)]


def chat_prompt(text: str, tokenizer: PreTrainedTokenizerBase, score: Callable[[str], float],
                max_new_tokens: int, answers: tuple[str, ...] = ()) -> ChatPrompt:
    """``text`` tokenized, its last question located, and the blocks of every mention of
    an answer before the question (a needle, or an earlier turn's reply)."""
    enc = tokenizer(text, return_offsets_mapping=True)
    q_start_char = text.rindex("Question: ") + len("Question: ")
    q_end_char = text.rindex("?") + 1
    starts = [a for a, _ in enc["offset_mapping"]]
    q0 = sum(1 for a in starts if a < q_start_char)
    q1 = sum(1 for a in starts if a < q_end_char)
    blocks: set[int] = set()
    for answer in answers:
        for m in re.finditer(re.escape(answer), text[:q_start_char]):
            t0 = sum(1 for a in starts if a < m.start())
            t1 = sum(1 for a in starts if a < m.end())
            blocks.update(range(max(0, t0 - ORACLE_LEAD) // _BLOCK, (t1 - 1) // _BLOCK + 1))
    return ChatPrompt(torch.tensor(enc["input_ids"]), (q0, q1), score, max_new_tokens,
                      tuple(sorted(blocks)))


def candidate_config(c: Candidate) -> EvictionConfig:
    """The config a candidate evicts and decodes under: the budget, prompt mode end."""
    return EvictionConfig(method="nexus", keep_ratio=BUDGET_RATIO, prompt_mode="end",
                          recent_blocks=c.recent)


def _config_of(session: StreamingSession) -> EvictionConfig:
    """The config ``session`` evicts under (a dense session has none to read)."""
    if session.config is None:
        raise ValueError("a dense session has no config to score or evict under; "
                         "StreamingSession.with_config gives it one")
    return session.config


def _scoring_view(session: StreamingSession, config: EvictionConfig) -> StreamingSession:
    """``session`` read under ``config`` (sharing its cache: gathering changes nothing)."""
    view = copy.copy(session)
    view.config = config
    return view


def _rows_mass(session: StreamingSession, window: int, attention_reduce: str) -> torch.Tensor:
    """The newest ``window`` rows' mass ``[window, N]``, combined over heads and layers by
    ``attention_reduce``."""
    config = _config_of(session).replace(attention_reduce=attention_reduce)
    mass = _scoring_view(session, config).block_mass(window)
    if mass.shape[0] != window:
        raise ValueError(f"the session kept {mass.shape[0]} query rows; {window} asked "
                         f"(a dense prefill keeps {CAPTURE_ROWS})")
    return mass


def per_head_mass(session: StreamingSession, window: int) -> torch.Tensor:
    """``[layers x heads, window, N]``: each scored layer's and query head's block mass of
    the newest ``window`` query rows, from the session's
    :class:`~nexus_vllm.core.evidence.DenseSequence` (what its gatherers read).
    """
    seq = session.dense_sequence(window)
    out = []
    for layer in seq.layers:
        hq, hkv = int(layer.queries.shape[1]), int(layer.keys.shape[1])
        for h in range(hq):
            kv = h // (hq // hkv)
            out.append(block_attention_mass(layer.queries[:, h:h + 1],
                                            layer.keys[:, kv:kv + 1], seq.block_size))
    mass = torch.stack(out)
    if mass.shape[1] != window:
        raise ValueError(f"the session kept {mass.shape[1]} query rows; {window} asked")
    return mass


def _row_range(c: Candidate, session: StreamingSession, p: ChatPrompt) -> tuple[int, int]:
    """Absolute positions ``[first, last)`` of the rows that score."""
    if c.rows == "question":
        return p.question
    if c.rows == "answer":
        return len(p.ids), session.seen
    return session.seen - c.window, session.seen


def _read_rows(mass: torch.Tensor, rows_reduce: str) -> torch.Tensor:
    """A block's score from its rows of ``mass`` ``[W, N]`` (:data:`ROWS_REDUCES`)."""
    if rows_reduce in ("mean", "max"):
        return direct_scores(mass, rows_reduce)
    if rows_reduce == "max of normalized":  # each row a distribution before the maximum
        return direct_scores(normalize_rows(mass), "max")
    if rows_reduce == "top 2":
        return mass.topk(min(2, mass.shape[0]), dim=0).values.sum(0)
    return direct_scores(mass, "max") + direct_scores(mass, "mean")  # "max + mean"


def candidate_weights(c: Candidate, session: StreamingSession, p: ChatPrompt) -> torch.Tensor:
    """Each live block's weight under ``c`` (Tensor[N]; larger keeps first).

    ``session`` holds the state the event reads, with ``session.config`` its config.
    """
    if c.knorm:
        return -session.key_norms()
    first, last = _row_range(c, session, p)
    window = session.seen - first
    if c.heads == "union":
        # Each head's view of the blocks; a block ranks as its best rank by any head, the
        # mean over heads breaking ties.
        per = per_head_mass(session, window)[:, :last - first].mean(1)  # [H, N]
        rank = torch.argsort(torch.argsort(-per, dim=1), dim=1).float()
        w = -rank.min(0).values + 1e-3 * per.mean(0) / per.mean(0).max()
    else:
        w = _read_rows(_rows_mass(session, window, c.heads)[:last - first], c.rows_reduce)
    w = w.double()
    back = torch.cat([w[1:], w[-1:]]) * c.carry_back
    w = torch.maximum(carry_forward(w, c.carry), back)
    if c.oracle and p.answer_blocks:
        bonus = torch.zeros_like(w)
        bonus[[b for b in p.answer_blocks if b < w.numel()]] = 1.0
        w = w / w.sum().clamp_min(1e-12) + bonus  # the answers' blocks outrank every other
    return w


@dataclass(frozen=True)
class GivenWeights(EvictionPolicy):
    """Top-K of weights computed outside the policy (``state["weights"]``, Tensor[N]),
    after the forced set every policy keeps. Not registered: no config names it."""

    name: ClassVar[str] = "given_weights"
    evidence: ClassVar[frozenset[str]] = frozenset()
    servable: ClassVar[bool] = False

    def score(self, evidence: Evidence, state: dict[str, Any] | None) -> torch.Tensor:
        if state is None or "weights" not in state:
            raise ValueError("GivenWeights scores the weights passed as state['weights']")
        weights: torch.Tensor = state["weights"]
        return weights


def evict_to(session: StreamingSession, weights: torch.Tensor, budget: int) -> None:
    """Keep the forced set and the top-``budget`` blocks by ``weights`` (Tensor[N] over
    the live blocks), dropping the rest from every full-attention layer."""
    n = weights.numel()
    if n <= budget:
        return
    cfg = _config_of(session)
    policy = GivenWeights(sink_blocks=cfg.sink_blocks, recent_blocks=cfg.recent_blocks)
    keep = policy.select(Evidence(num_blocks=n), budget, state={"weights": weights})
    session.keep_blocks(keep)


def greedy(session: StreamingSession, logits: torch.Tensor, n: int, eos: set[int],
           decode_events: bool) -> list[int]:
    """Up to ``n`` greedy tokens from ``logits`` on, feeding each but the last (with the
    session's decode events when ``decode_events``): the transformers path's decode loop,
    :func:`~nexus_vllm.hf.generate.greedy_ids`."""
    return greedy_ids(session, logits, n, eos, decode_events=decode_events)


def dense_states(model: torch.nn.Module, p: ChatPrompt, defers: set[int], eos: set[int]) -> None:
    """Record in ``p.dense_states`` the uncompressed state after the prompt and after
    each deferred answer length in ``defers`` (one the answer ended before is absent)."""
    session = StreamingSession(model, None, prompt_tokens=len(p.ids),
                               capture_rows=CAPTURE_ROWS)
    logits = None
    for start in range(0, len(p.ids), 512):
        logits = session.forward(p.ids[start:start + 512])
    assert logits is not None
    last = logits[-1]
    generated: list[int] = []
    for d in range(max(defers) + 1):
        if d in defers:
            p.dense_states[d] = (session.clone(), last, list(generated))
        tok = int(torch.argmax(last))
        generated.append(tok)
        if tok in eos:
            break
        last = session.forward(torch.tensor([tok]))[-1]


def run_candidate(c: Candidate, tokenizer: PreTrainedTokenizerBase, p: ChatPrompt, eos: set[int]) -> str:
    """``c``'s answer to ``p`` (whose :func:`dense_states` hold 0 and ``c.defer``)."""
    cfg = candidate_config(c)
    if c.defer not in p.dense_states:  # the answer ended before d tokens: nothing to defer
        return str(tokenizer.decode(p.dense_states[0][2] or [], skip_special_tokens=True))
    base, logits, generated = p.dense_states[0 if c.graded else c.defer]
    session = base.with_config(cfg)
    if c.graded:
        budget = math.ceil(c.graded * BUDGET_RATIO * cdiv(session.seen, cfg.block_size))
        first = Candidate("graded", heads=c.heads, carry=c.carry)  # the prompt's last rows
        evict_to(session, candidate_weights(first, session, p), budget)
        generated = greedy_ids(session, logits, c.defer + 1, eos, decode_events=False)
        if len(generated) <= c.defer:  # ended before the deferred event
            return str(tokenizer.decode(generated, skip_special_tokens=True))
        generated, following = generated[:c.defer], generated[c.defer]
        logits = torch.zeros_like(logits)
        logits[following] = 1.0  # the token it just predicted, fed next as usual
    evict_to(session, candidate_weights(c, session, p), budget_blocks(cfg, session.seen))
    # The event just ran: the decode clock starts from it.
    session.trigger = EvictionTrigger(cfg, len(p.ids))
    rest = greedy_ids(session, logits, p.max_new_tokens - len(generated), eos)
    return str(tokenizer.decode(generated + rest, skip_special_tokens=True))


class AnswerRanks(TypedDict):
    """:func:`answer_ranks`: the oracle's blocks as a candidate ranks them."""

    blocks: int  # live blocks at the event
    budget: int  # blocks the budget keeps
    free: int  # of those, outside the forced set
    answer_blocks: list[int]
    ranks: list[int | None]  # each answer block's rank outside the forced set (None: forced)


def answer_ranks(c: Candidate, p: ChatPrompt) -> AnswerRanks:
    """Where ``c`` ranks the oracle's blocks at the prompt-end event: each answer block's
    0-based rank among the blocks outside the forced set (None: forced), and how many of
    those the budget keeps (``free``)."""
    cfg = candidate_config(c)
    session = _scoring_view(p.dense_states[0][0], cfg)
    w = candidate_weights(c, session, p)
    forced = set(forced_blocks(w.numel(), cfg.sink_blocks, cfg.recent_blocks).tolist())
    order = [b for b in torch.argsort(-w, stable=True).tolist() if b not in forced]
    budget = budget_blocks(cfg, session.seen)
    return {"blocks": w.numel(), "budget": budget, "free": max(0, budget - len(forced)),
            "answer_blocks": list(p.answer_blocks),
            "ranks": [None if b in forced else order.index(b) for b in p.answer_blocks]}
