"""When the budget holds (``prompt_mode``) on the transformers path, tiny random Llama.

``end``: the prompt is computed whole (or under ``prefill_budget``), then one event after
the question evicts down to the budget with the question's last tokens as its window.
``keep``: no prompt token is ever evicted; the budget counts generated tokens.
"""

from __future__ import annotations

import pytest
import torch

from nexus_vllm.core import ConfigError, num_blocks_for
from nexus_vllm.core.budget import bound_blocks, budget_blocks, hard_limit, target_blocks
from nexus_vllm.hf import encode_prompt, generate, generate_ids, make_config, run_sample
from nexus_vllm.hf.generate import finish_sample, prefill_sample

torch.set_num_threads(1)

CONTEXT = ("The quick brown fox jumps over the lazy dog while the magic number is 4815162. "
           "Nothing else happens here, the river keeps flowing and birds sing. ") * 5
QUESTION = " Question: what is the magic number? Answer:"
ANSWER = " 4815162"
KNOBS = {"block_size": 8, "recent_blocks": 2, "interval": 4, "window": 4,
         "prompt_window": 8, "skip_layers": 1}
METHODS = ["nexus", "snapkv", "tova", "knorm", "h2o"]


@pytest.mark.parametrize("method", METHODS)
def test_end_mode_one_event_after_the_question(model, tok, method: str) -> None:
    _, session = generate(model, tok, CONTEXT, QUESTION, method=method, budget=0.3,
                          chunk_size=64, max_new_tokens=12, return_session=True,
                          prompt_mode="end", **KNOBS)
    n_prompt = encode_prompt(tok, CONTEXT, QUESTION).n_prompt
    prefill = [e for e in session.events if e.prefill]
    assert [e.seen for e in prefill] == [n_prompt]
    event = prefill[0]
    assert event.budget_blocks == budget_blocks(session.config, n_prompt)
    assert event.blocks_before == num_blocks_for(n_prompt, 8)  # nothing evicted before
    assert event.blocks_after <= event.budget_blocks
    if event.mass is not None and method != "tova":
        # The window: the prompt's last prompt_window tokens, the question's.
        assert event.mass.shape[0] == KNOBS["prompt_window"]


def test_end_mode_prefill_budget_caps_the_prompt(model, tok) -> None:
    _, session = generate(model, tok, CONTEXT, QUESTION, method="nexus", budget=0.3,
                          chunk_size=64, max_new_tokens=4, return_session=True,
                          prompt_mode="end", prefill_budget=256, **KNOBS)
    n_prompt = encode_prompt(tok, CONTEXT, QUESTION).n_prompt
    mid = [e for e in session.events if e.prefill and e.seen < n_prompt]
    assert mid and all(e.budget_blocks == 256 // 8 for e in mid)
    assert all(e.blocks_after <= 256 // 8 for e in mid)
    assert [e.seen for e in session.events if e.prefill][-1] == n_prompt


@pytest.mark.parametrize("method", ["nexus", "h2o", "knorm"])
def test_keep_mode_never_evicts_the_prompt(model, tok, method: str) -> None:
    ids = tok(CONTEXT + QUESTION)["input_ids"]
    n_prompt = len(ids)
    cfg = make_config(method, 32, chunk_size=64, prompt_mode="keep", **KNOBS)
    _, session = generate_ids(model, ids, cfg, max_new_tokens=80)  # no eos: 80 tokens
    assert session.events and not any(e.prefill for e in session.events)
    prompt_positions = torch.arange(n_prompt)
    for e in session.events:
        assert torch.equal(e.kept_positions[:n_prompt], prompt_positions)
        generated_blocks = e.blocks_after - num_blocks_for(n_prompt, 8)
        assert generated_blocks <= budget_blocks(session.config, e.seen - n_prompt)


@pytest.mark.parametrize("mode", ["end", "keep"])
@pytest.mark.parametrize("method", ["nexus", "knorm"])
def test_forking_the_dense_prompt_equals_a_full_run(model, tok, method: str,
                                                    mode: str) -> None:
    """The evaluation's shortcut: a dense prompt state turned evicting is exact."""
    cfg = make_config(method, 0.3, chunk_size=64, seed=3, prompt_mode=mode, **KNOBS)
    full = run_sample(model, tok, CONTEXT, QUESTION, ANSWER, method=method, budget=0.3,
                      chunk_size=64, max_new_tokens=12, seed=3, prompt_mode=mode, **KNOBS)
    dense = prefill_sample(model, tok, CONTEXT, QUESTION, ANSWER, config=None,
                           chunk_size=64, capture_rows=16)
    forked = finish_sample(dense.fork(cfg, seed=3), tok, max_new_tokens=12)
    assert forked.text == full.text
    assert forked.events == full.events == (1 if mode == "end" else 0)
    assert forked.cache_tokens == full.cache_tokens
    assert torch.equal(forked.logprobs, full.logprobs)


def test_fork_refuses_what_it_cannot_reproduce(model, tok) -> None:
    dense = prefill_sample(model, tok, CONTEXT, QUESTION, ANSWER, config=None,
                           chunk_size=64, capture_rows=4)
    with pytest.raises(ValueError, match="prompt_mode"):
        dense.fork(make_config("nexus", 0.3, prompt_mode="stream", **KNOBS), seed=0)
    with pytest.raises(ValueError, match="query rows"):
        dense.fork(make_config("nexus", 0.3, prompt_mode="end", **KNOBS), seed=0)


@pytest.mark.parametrize("mode", ["stream", "end", "keep"])
def test_generate_ids_streams_each_mode_within_its_hard_limit(model, tok, mode: str) -> None:
    ids = tok(CONTEXT + QUESTION)["input_ids"]
    cfg = make_config("nexus", 96, chunk_size=64, prompt_mode=mode, **KNOBS)
    out, session = generate_ids(model, ids, cfg, max_new_tokens=40)
    assert out
    for e in session.events:
        assert e.blocks_before <= hard_limit(cfg, e.seen, len(ids))
        assert e.blocks_before <= bound_blocks(cfg, len(ids), len(ids) + 40)
        assert e.blocks_after <= target_blocks(cfg, e.seen, len(ids))


@pytest.mark.parametrize(("knobs", "field"), [
    ({"prompt_mode": "later"}, "prompt_mode"),
    ({"prompt_mode": "end", "prefill_budget": 200}, "prefill_budget"),  # below the budget
    ({"prompt_mode": "stream", "prefill_budget": 512}, "prefill_budget"),
    ({"prompt_mode": "end", "prefill_budget": 0}, "prefill_budget"),
    ({"prefill_sampler": "best"}, "prefill_sampler"),
])
def test_bad_mode_values_name_the_field(knobs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        make_config("nexus", 256, **knobs)
    assert err.value.field == field
