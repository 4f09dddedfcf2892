"""The streaming-regime oracle: answers located in token ids, kept first at every event."""

from __future__ import annotations

import pytest
import torch

from nexus_vllm.core import Evidence, get_policy
from nexus_vllm.eval.oracle import (
    ORACLE_LEAD,
    OracleFirst,
    answer_blocks,
    oracle_config,
)
from nexus_vllm.hf import make_config
from nexus_vllm.hf.testing import byte_tokenizer, tiny_llama

torch.set_num_threads(1)
BLOCK = 8


def test_answer_blocks_cover_each_mention_and_its_lead() -> None:
    tok = byte_tokenizer()  # one token per byte: token i is character i
    text = "x" * 100 + "the code is 4711." + "y" * 60 + "again 4711" + "z" * 40
    ids = tok(text)["input_ids"]
    first, second = text.index("4711"), text.rindex("4711")
    got = answer_blocks(tok, ids, ["4711"], end=len(ids), block_size=BLOCK)
    want = set(range((first - ORACLE_LEAD) // BLOCK, (first + 3) // BLOCK + 1))
    want |= set(range((second - ORACLE_LEAD) // BLOCK, (second + 3) // BLOCK + 1))
    assert got == tuple(sorted(want))
    # Only ids[:end] are searched (the question's own words are not a mention).
    assert answer_blocks(tok, ids, ["4711"], end=second, block_size=BLOCK) == tuple(sorted(
        range((first - ORACLE_LEAD) // BLOCK, (first + 3) // BLOCK + 1)))
    assert answer_blocks(tok, ids, ["nowhere", ""], end=len(ids), block_size=BLOCK) == ()


def _knorm_evidence(norms: list[float]) -> Evidence:
    return Evidence(key_norms=torch.tensor(norms))


def test_oracle_keeps_the_answer_blocks_across_events() -> None:
    """KNorm would drop logical block 3 (the highest norm) at both events; the oracle
    keeps it, and tracks which logical block each live block is as blocks come and go."""
    base = get_policy("knorm", sink_blocks=1, recent_blocks=2)
    oracle = OracleFirst(sink_blocks=1, recent_blocks=2, base=base,
                         answer_blocks=frozenset({3}))
    state: dict[str, object] = {}
    norms = [1.0, 2.0, 2.0, 9.0, 1.5, 1.5, 3.0, 3.0, 2.5, 2.5]
    assert 3 not in base.select(_knorm_evidence(norms), 6).tolist()
    keep = oracle.select(_knorm_evidence(norms), 6, state=state)
    assert 3 in keep.tolist()
    live = state["oracle_live_blocks"]
    assert torch.equal(live, keep)  # the first event: live block i is logical block i
    # Four new blocks arrive after the newest kept one (logical 9): logical 10..13.
    norms2 = [norms[i] for i in keep.tolist()] + [1.1, 1.2, 1.3, 1.4]
    keep2 = oracle.select(_knorm_evidence(norms2), 6, state=state)
    logical = torch.cat([live, torch.arange(10, 14)])
    assert 3 in logical[keep2].tolist()
    assert torch.equal(state["oracle_live_blocks"], logical[keep2])
    assert "oracle_scored_blocks" not in state


def test_oracle_refuses_what_it_cannot_track() -> None:
    base = get_policy("nexus")
    with pytest.raises(ValueError, match="recent_blocks must be >= 1"):
        OracleFirst(sink_blocks=1, recent_blocks=0, base=base)
    with pytest.raises(ValueError, match="base policy"):
        OracleFirst(sink_blocks=1, recent_blocks=2)
    oracle = OracleFirst(sink_blocks=1, recent_blocks=2, base=base)
    mass = torch.full((2, 6), 1 / 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="per-request state"):
        oracle.select(Evidence(mass), 4)


def test_a_streamed_prompt_keeps_the_answer_tokens() -> None:
    """On the transformers path, in stream, at a budget of a quarter of the prompt: every
    token of the answer's blocks is still cached when the question comes."""
    from nexus_vllm.hf.generate import encode_prompt, prefill_sample

    tok = byte_tokenizer()
    model = tiny_llama(vocab_size=len(tok))
    context = "filler text. " * 30 + "The vault code is 90210. " + "more filler. " * 40
    question, answer = " What is the vault code?", " 90210"
    split = encode_prompt(tok, context, question, answer=answer)
    config = make_config("nexus", 256, chunk_size=64, block_size=BLOCK, skip_layers=1,
                         prompt_mode="stream")
    assert config is not None
    blocks = answer_blocks(tok, split.ids.tolist(), ["90210"], end=split.n_context,
                           block_size=BLOCK)
    assert blocks
    state = prefill_sample(model, tok, context, question, answer,
                           config=oracle_config(config, blocks), chunk_size=64)
    assert state.session.num_events > 3
    cached_blocks = set((state.session.positions // BLOCK).tolist())
    assert set(blocks) <= cached_blocks
