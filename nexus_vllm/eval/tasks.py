"""Seeded RULER-style long-context tasks, generated offline (after NVIDIA/RULER, 2404.06654).

Every generator is a pure function of ``(task, seed, index, target_tokens, tokenizer,
protocol)``: the same arguments give the same sample. The haystack length is fitted by a
binary search on tokens so that the whole prompt plus the answer fits ``target_tokens``.

What each task asks, and its haystack (RULER's noise sentences or real prose), are in
:mod:`nexus_vllm.eval.task_bodies`; this module fits them to a token target and wraps them
in a protocol's prompt.

Protocols: ``question-last`` puts the question only after the context (eviction during
ingestion cannot know what matters); ``question-first`` also states it in a preamble before
the context (the window queries know the task). Both restate the question at the end, as
RULER's templates do, and end with RULER's answer prefix inside the assistant's turn: the
*completion shape*, whose newest tokens already start the answer.

``chat`` is the shape ``/v1/chat/completions`` serves: instruction, document and question
in one user message, rendered by the model's chat template up to the assistant's header,
with no answer prefix. The model writes its answer from scratch; the reference it is
teacher-forced with is the answer prefix followed by the answer (what a model that
restates the question says). Decide on this shape (docs/results.md); keep the completion
shape as a check that nothing regresses.

One task is scored against dense's own answer rather than a reference (``metric
"dense"``: ROUGE-L F1 against the uncompressed model's greedy answer, 1 for dense by
definition): ``summary`` asks for a summary of an essay, whose right answer is whatever
the uncompressed model writes.
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from nexus_vllm.eval.task_bodies import (
    CHAT_ONLY_TASKS,
    TASKS,
    TaskBody,
    essay_sentences,
    task_metric,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "CHAT_ONLY_TASKS",
    "PROTOCOLS",
    "TASKS",
    "Sample",
    "SampleMeta",
    "essay_sentences",
    "make_sample",
    "rouge_l",
    "string_match_all",
    "string_match_part",
    "task_metric",
]

PROTOCOLS = ("question-last", "question-first", "chat")


class SampleMeta(TypedDict, total=False):
    """What a :class:`Sample` carries besides its prompt."""

    units: int  # the haystack's size (sentences, words or list items)
    messages: list[dict[str, str]]  # the chat shape's request, as a chat client sends it


@dataclass(frozen=True)
class Sample:
    """One generated sample.

    ``preamble + context + question`` is the prompt; ``answers`` are the references for the
    string-match metric (``metric`` ``"all"`` or ``"part"``); ``target`` is the text
    teacher-forced for the likelihood metrics. With ``metric == "dense"`` the reference is
    the uncompressed model's answer, known only once dense has run: ``answers`` and
    ``target`` are empty until :meth:`with_reference` fills them.
    """

    task: str
    index: int
    seed: int
    protocol: str
    preamble: str
    context: str
    question: str
    answers: tuple[str, ...]
    target: str
    metric: str  # "all", "part" or "dense"
    max_new_tokens: int
    num_tokens: int  # prompt tokens (preamble + context + question)
    meta: SampleMeta = field(default_factory=SampleMeta, compare=False)

    @property
    def needs_reference(self) -> bool:
        """Whether the reference is dense's answer, not set yet."""
        return self.metric == "dense" and not self.answers

    def with_reference(self, dense_answer: str) -> Sample:
        """This sample scored against ``dense_answer`` (a ``metric "dense"`` task)."""
        if self.metric != "dense":
            raise ValueError(f"task {self.task!r} has its own reference")
        text = dense_answer.strip() or "."
        return dataclasses.replace(self, answers=(text,), target=text)

    def score(self, prediction: str) -> float:
        """RULER string-match score of ``prediction`` against ``answers`` (0..1); for
        ``metric "dense"``, ROUGE-L F1 against dense's answer."""
        if self.metric == "dense":
            if not self.answers:
                raise ValueError("a dense-referenced sample is scored after dense has run "
                                 "(Sample.with_reference)")
            return rouge_l(prediction, self.answers[0])
        fn = string_match_all if self.metric == "all" else string_match_part
        return fn(prediction, self.answers)


def string_match_all(prediction: str, references: tuple[str, ...] | list[str]) -> float:
    """Fraction of references found in the prediction (case-insensitive)."""
    pred = prediction.lower()
    return sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: tuple[str, ...] | list[str]) -> float:
    """1 if any reference is found in the prediction (case-insensitive), else 0."""
    pred = prediction.lower()
    return float(max(r.lower() in pred for r in references))


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 of ``prediction`` against ``reference``: the longest common subsequence
    of their lower-cased words, as a harmonic mean of precision and recall (0..1; 1 for
    equal texts, also two empty ones)."""
    a = re.findall(r"\w+", prediction.lower())
    b = re.findall(r"\w+", reference.lower())
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


# ---------------------------------------------------------------------------- assembly
def _chat_wrap(tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
    """(head, tail) around the user message in the tokenizer's chat template, if any."""
    if getattr(tokenizer, "chat_template", None):
        marker = "\x00NEXUS\x00"
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}],
                                             tokenize=False, add_generation_prompt=True)
        if isinstance(text, str) and marker in text:
            head, tail = text.split(marker, 1)
            return head, tail
    return "", "\n"


def _assemble(body: TaskBody, units: int, protocol: str, wrap: tuple[str, str]
              ) -> tuple[str, str, str]:
    head, tail = wrap
    preamble = head + body.instruction + "\n"
    if protocol == "question-first":
        preamble += f"Question: {body.question}\n"
    preamble += "\n"
    context = body.build(units)
    # The chat shape ends at the assistant's header: the model writes the answer's start.
    prefix = "" if protocol == "chat" else body.answer_prefix
    question = f"\n\nQuestion: {body.question}{tail}{prefix}"
    return preamble, context, question


def _user_message(body: TaskBody, context: str) -> str:
    """The chat shape's one user message (what a ``/v1/chat/completions`` client sends)."""
    return f"{body.instruction}\n\n{context}\n\nQuestion: {body.question}"


def _count(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer(text)["input_ids"])


def make_sample(task: str, *, seed: int, index: int, target_tokens: int,
                tokenizer: PreTrainedTokenizerBase, protocol: str = "question-last") -> Sample:
    """Generate sample ``index`` of ``task`` for ``seed``, fitted to ``target_tokens``.

    The prompt (preamble + context + question) plus ``max_new_tokens`` fits
    ``target_tokens``; the haystack size is the largest that does (binary search).
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if task in CHAT_ONLY_TASKS and protocol != "chat":
        raise ValueError(f"task {task!r} has no answer prefix: it runs in the 'chat' "
                         f"protocol only, not {protocol!r}")
    if target_tokens < 256:
        raise ValueError(f"target_tokens must be >= 256, got {target_tokens}")
    # One RNG per (task, seed, index): protocols share the same facts and haystack.
    rng = random.Random(f"{task}|{seed}|{index}")
    body = TASKS[task](rng)
    wrap = _chat_wrap(tokenizer)
    max_new_tokens, target = body.max_new_tokens, body.target
    if protocol == "chat" and body.metric != "dense":
        # The answer restates the question first (as the answer prefix does).
        target = body.answer_prefix + body.target
        max_new_tokens += _count(tokenizer, body.answer_prefix)
    limit = target_tokens - max_new_tokens

    def size(units: int) -> int:
        return _count(tokenizer, "".join(_assemble(body, units, protocol, wrap)))

    lo, hi = 1, 8
    while hi < body.unit_cap and size(hi) <= limit:
        lo, hi = hi, hi * 2
    hi = min(hi, body.unit_cap)
    if size(lo) > limit:
        raise ValueError(f"target_tokens={target_tokens} is too small for task {task!r}")
    while lo < hi:  # largest units with size <= limit
        mid = (lo + hi + 1) // 2
        if size(mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    preamble, context, question = _assemble(body, lo, protocol, wrap)
    meta: SampleMeta = {"units": lo}
    if protocol == "chat":
        meta["messages"] = [{"role": "user", "content": _user_message(body, context)}]
    return Sample(task=task, index=index, seed=seed, protocol=protocol, preamble=preamble,
                  context=context, question=question, answers=body.answers,
                  target=target, metric=body.metric, max_new_tokens=max_new_tokens,
                  num_tokens=_count(tokenizer, preamble + context + question), meta=meta)
