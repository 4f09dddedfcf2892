"""Offline task generators: determinism per seed, fitting, answers present, metrics."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from nexus_vllm.eval.tasks import (
    PROTOCOLS,
    TASKS,
    essay_sentences,
    make_sample,
    string_match_all,
    string_match_part,
)
from nexus_vllm.hf.testing import byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.mark.parametrize("task", sorted(TASKS))
def test_deterministic_per_seed_and_fitted(tok, task: str) -> None:
    a = make_sample(task, seed=3, index=1, target_tokens=3000, tokenizer=tok)
    b = make_sample(task, seed=3, index=1, target_tokens=3000, tokenizer=tok)
    c = make_sample(task, seed=4, index=1, target_tokens=3000, tokenizer=tok)
    d = make_sample(task, seed=3, index=2, target_tokens=3000, tokenizer=tok)
    assert a == b
    assert a.context != c.context and a.context != d.context
    full = len(tok(a.preamble + a.context + a.question)["input_ids"])
    assert full == a.num_tokens
    assert a.num_tokens + a.max_new_tokens <= 3000
    assert a.num_tokens + a.max_new_tokens > 3000 * 0.7  # the haystack fills the target
    # The reference answer is recoverable from the context (not from the question alone),
    # except for the counting tasks whose answers are words of the list.
    for ans in a.answers:
        assert ans in a.context
        assert ans not in a.question or task == "vt"
    assert a.score(" ".join(a.answers)) == 1.0
    assert a.score("nothing relevant") == 0.0


@pytest.mark.parametrize("task", ["niah_single_prose", "vt"])
def test_protocols_share_facts_and_differ_in_preamble(tok, task: str) -> None:
    last, first = (make_sample(task, seed=0, index=0, target_tokens=1200, tokenizer=tok,
                               protocol=p) for p in PROTOCOLS)
    assert last.answers == first.answers
    q = last.question.split("Question: ", 1)[1].split("\n")[0].split("<")[0]
    assert q not in last.preamble
    assert q in first.preamble  # question-first states the task before the context
    assert q in last.question and q in first.question


def test_prose_haystack_is_real_essay_text(tok) -> None:
    s = make_sample("niah_single_prose", seed=0, index=0, target_tokens=1200, tokenizer=tok)
    sentences = essay_sentences()
    assert len(sentences) > 1000
    hits = sum(1 for sent in sentences if len(sent) > 40 and sent in s.context)
    assert hits >= 5


def test_counting_tasks_answers_are_the_most_frequent(tok) -> None:
    cwe = make_sample("cwe", seed=0, index=0, target_tokens=2000, tokenizer=tok)
    words = Counter(re.findall(r"\d+\. (\w+)", cwe.context))
    top = {w for w, _ in words.most_common(10)}
    assert top == set(cwe.answers)
    assert words.most_common(11)[-1][1] < words[cwe.answers[0]]
    fwe = make_sample("fwe", seed=0, index=0, target_tokens=2000, tokenizer=tok)
    counts = Counter(fwe.context.split())
    assert [w for w, _ in counts.most_common(3)] == list(fwe.answers)


def test_string_match_metrics() -> None:
    refs = ("1234567", "7654321")
    assert string_match_all("the numbers are 1234567 and 7654321", refs) == 1.0
    assert string_match_all("only 1234567", refs) == 0.5
    assert string_match_part("only 1234567", refs) == 1.0
    assert string_match_part("none", refs) == 0.0
    assert string_match_all("ABC", ("abc",)) == 1.0  # case-insensitive


def test_bad_arguments(tok) -> None:
    with pytest.raises(ValueError, match="task"):
        make_sample("nope", seed=0, index=0, target_tokens=1000, tokenizer=tok)
    with pytest.raises(ValueError, match="protocol"):
        make_sample("vt", seed=0, index=0, target_tokens=1000, tokenizer=tok, protocol="x")
    with pytest.raises(ValueError, match="target_tokens"):
        make_sample("vt", seed=0, index=0, target_tokens=100, tokenizer=tok)
