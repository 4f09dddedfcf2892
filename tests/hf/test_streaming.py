"""Streaming eviction on a tiny random Llama: dense equality, budgets, positions, masks."""

from __future__ import annotations

import pytest
import torch

from nexus_vllm.core import num_blocks_for
from nexus_vllm.core.budget import budget_blocks
from nexus_vllm.hf import StreamingSession, encode_prompt, generate, make_config, run_sample
from tests.core.policy_cases import POLICY_CASES

torch.set_num_threads(1)

CONTEXT = ("The quick brown fox jumps over the lazy dog while the magic number is 4815162. "
           "Nothing else happens here, the river keeps flowing and birds sing. ") * 5
QUESTION = " Question: what is the magic number? Answer:"
# Every registered policy, from the case table (a new policy is tested here by its row).
METHODS = [case.name for case in POLICY_CASES if not case.head_only]
# Small blocks and chunks so a ~900-token prompt sees many events.
# The streaming setting (an event after every prompt chunk): what these tests exercise.
KNOBS = {"block_size": 8, "recent_blocks": 2, "interval": 4, "window": 4,
         "prompt_window": 8, "skip_layers": 1, "prompt_mode": "stream"}


def test_byte_tokenizer_round_trips(tok) -> None:
    text = "Hello world, the magic number is 1234567. café"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_encode_prompt_splits_like_one_string(tok) -> None:
    split = encode_prompt(tok, CONTEXT, QUESTION, preamble="Read this. ")
    assert split.ids.tolist() == tok("Read this. " + CONTEXT + QUESTION)["input_ids"]
    assert split.n_context == len(tok("Read this. " + CONTEXT)["input_ids"])
    assert split.n_prompt == split.ids.numel()


@pytest.mark.parametrize("chunk_size", [64, 4096])
def test_dense_equals_model_generate(model, tok, chunk_size: int) -> None:
    enc = tok(CONTEXT + QUESTION, return_tensors="pt")
    ref = model.generate(**enc, max_new_tokens=12, do_sample=False)
    expected = tok.decode(ref[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    got = generate(model, tok, CONTEXT, QUESTION, method="dense", budget=None,
                   chunk_size=chunk_size, max_new_tokens=12)
    assert got == expected


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", [0.3, 160])
def test_cache_within_budget_after_every_event(model, tok, method: str, budget) -> None:
    text, session = generate(model, tok, CONTEXT, QUESTION, method=method, budget=budget,
                             chunk_size=64, max_new_tokens=20, return_session=True,
                             **KNOBS)
    # Every generated token but the last was fed back: the session saw the prompt plus
    # 1..19 of them, and the text decodes something (no eos at the very first step).
    generated = session.seen - encode_prompt(tok, CONTEXT, QUESTION).n_prompt + 1
    assert 1 < generated <= 20 and text
    cfg = session.config
    assert session.events, "the prompt is long enough that eviction must fire"
    assert any(not e.prefill for e in session.events), "decode events must fire too"
    for e in session.events:
        assert e.blocks_after <= e.budget_blocks
        assert e.budget_blocks == budget_blocks(cfg, e.seen)
        assert e.blocks_after == num_blocks_for(e.kept_positions.numel(), cfg.block_size)
        # Evicted tokens keep their original positions: strictly increasing logical ids.
        assert torch.all(e.kept_positions[1:] > e.kept_positions[:-1])
        assert int(e.kept_positions[-1]) == e.seen - 1  # the newest token is never evicted
    # Cache tensors and the position bookkeeping agree on every layer.
    for layer in session.cache.layers:
        assert layer.keys.shape[-2] == session.positions.numel() == session.cache_len


def test_eviction_equals_masked_full_recompute(model, tok) -> None:
    """Streaming with eviction == one forward whose mask hides what each token could not see.

    This pins RoPE positions (no re-rotation) and the causal mask over a shortened cache.
    """
    cfg = make_config("nexus", 0.25, **KNOBS)
    ids = torch.tensor(tok(CONTEXT)["input_ids"])
    session = StreamingSession(model, cfg)
    n = ids.numel()
    visible = torch.zeros(n, n, dtype=torch.bool)
    last = None
    for start in range(0, n, 48):
        end = min(start + 48, n)
        before = session.positions.clone()
        last = session.forward(ids[start:end], logits_to_keep=1)[-1]
        visible[start:end, before] = True
        visible[start:end, start:end] = torch.ones(end - start, end - start).tril().bool()
        session.evict(prefill=True)
    assert session.num_events > 3
    with torch.no_grad():
        out = model(input_ids=ids[None], attention_mask=visible[None, None])
    assert last is not None
    torch.testing.assert_close(last, out.logits[0, -1].float(), atol=2e-4, rtol=1e-4)


def test_same_seed_same_result_and_seed_matters(model, tok) -> None:
    kw = dict(method="nexus", budget=0.3, chunk_size=64, max_new_tokens=6,
              return_session=True, **KNOBS)
    _, a = generate(model, tok, CONTEXT, QUESTION, seed=1, **kw)
    _, b = generate(model, tok, CONTEXT, QUESTION, seed=1, **kw)
    assert torch.equal(a.positions, b.positions)
    kept = {tuple(generate(model, tok, CONTEXT, QUESTION, seed=s, **kw)[1].positions.tolist())
            for s in range(2, 6)}
    assert len(kept) > 1, "pps sampling should depend on the seed"


def test_run_sample_teacher_forcing_matches_token_by_token_decode(model, tok) -> None:
    # Teacher forcing feeds the answer in pieces of `interval` tokens; it must equal feeding
    # it one token at a time as greedy decoding does (same events, same cache states).
    answer = " The magic number is 4815162, as stated."
    res = run_sample(model, tok, CONTEXT, QUESTION, answer, method="h2o", budget=0.3,
                     chunk_size=64, max_new_tokens=10, **KNOBS)
    greedy = generate(model, tok, CONTEXT, QUESTION, method="h2o", budget=0.3, chunk_size=64,
                      max_new_tokens=10, **KNOBS)
    assert res.text == greedy
    split = encode_prompt(tok, CONTEXT, QUESTION, answer=answer)
    # The reference knows where the prompt ends, as run_sample's session does: decode
    # events are bounded by one decode interval, prompt chunks by one chunk.
    session = StreamingSession(model, make_config("h2o", 0.3, chunk_size=64, **KNOBS),
                               prompt_tokens=split.n_prompt)
    ids = split.ids
    for start in range(0, split.n_context, 64):
        last = session.forward(ids[start:min(start + 64, split.n_context)])[-1]
        session.evict(prefill=True)
    rows = [last[None], session.forward(ids[split.n_context:split.n_prompt], logits_to_keep=0)]
    events_before = session.num_events
    for t in ids[split.n_prompt:-1]:
        rows.append(session.forward(t[None]))
        session.decode_step_done()
    assert session.num_events > events_before, "the forced answer must cross a decode event"
    ref = torch.cat(rows).log_softmax(-1)
    torch.testing.assert_close(res.logprobs, ref, atol=2e-4, rtol=1e-4)
    assert res.n_answer == ids.numel() - split.n_prompt
    assert res.answer_loglik < 0


def test_dense_run_sample_logprobs_match_full_forward(model, tok) -> None:
    answer = " 4815162."
    res = run_sample(model, tok, CONTEXT, QUESTION, answer, method="dense", budget=None,
                     chunk_size=100)
    split = encode_prompt(tok, CONTEXT, QUESTION, answer=answer)
    with torch.no_grad():
        full = model(input_ids=split.ids[None]).logits[0].float().log_softmax(-1)
    ref = full[split.n_context - 1: -1]
    torch.testing.assert_close(res.logprobs, ref, atol=2e-4, rtol=1e-4)
    assert torch.equal(res.targets, split.ids[split.n_context:])


def test_bad_budget_rejected() -> None:
    with pytest.raises(ValueError, match="budget"):
        make_config("nexus", 1.5)
    with pytest.raises(ValueError, match="budget"):
        make_config("nexus", 0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_llama_family_models(tok, family: str) -> None:
    from nexus_vllm.hf.testing import tiny_model

    m = tiny_model(family, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    enc = tok(CONTEXT + QUESTION, return_tensors="pt")
    ref = m.generate(**enc, max_new_tokens=6, do_sample=False)
    expected = tok.decode(ref[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert generate(m, tok, CONTEXT, QUESTION, method="dense", budget=None, chunk_size=64,
                    max_new_tokens=6) == expected
    _, session = generate(m, tok, CONTEXT, QUESTION, method="nexus", budget=0.3, chunk_size=64,
                          max_new_tokens=6, return_session=True, **KNOBS)
    assert session.events and all(e.blocks_after <= e.budget_blocks for e in session.events)


def test_layer_stride_scores_every_other_layer(model, tok) -> None:
    """``layer_stride=2`` combines the mass of layers 0 and 2 of 3 only (by the config's
    ``attention_reduce``)."""
    from nexus_vllm.core import block_attention_mass, combine_layer_masses

    cfg = make_config("nexus", 0.3, **{**KNOBS, "skip_layers": 0, "layer_stride": 2})
    session = StreamingSession(model, cfg)
    session.forward(torch.tensor(tok(CONTEXT)["input_ids"][:200]))
    assert list(session._scored_layers()) == [0, 2]  # the tiny model has 3 layers
    want = []
    for li in (0, 2):
        q = session._queries[li]
        assert q is not None
        k = session.cache.layers[li].keys[0].transpose(0, 1)
        want.append(block_attention_mass(q[:, -8:].transpose(0, 1), k, cfg.block_size,
                                         attention_reduce=cfg.attention_reduce))
    torch.testing.assert_close(session.block_mass(8), combine_layer_masses(want, cfg.attention_reduce))
    every = StreamingSession(model, cfg.replace(layer_stride=1))
    every.forward(torch.tensor(tok(CONTEXT)["input_ids"][:200]))
    assert list(every._scored_layers()) == [0, 1, 2]
    assert not torch.allclose(every.block_mass(8), session.block_mass(8))
