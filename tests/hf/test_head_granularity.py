"""Head granularity on the transformers path: each (layer, KV head) keeps its own tokens
(nexus_vllm.core.head_paged), masked out of that head's attention."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nexus_vllm.core.head_paged import forced_positions, head_blocks_held
from nexus_vllm.core.head_pages import HeadPages, tail_block_of
from nexus_vllm.hf import StreamingSession, make_config
from nexus_vllm.hf.streaming import with_head_mask
from nexus_vllm.hf.testing import tiny_model
from nexus_vllm.hf.tiny_mla import tiny_deepseek_v2

CONTEXT = ("The budget keeps the cache small while tokens stream through the model. " * 6
           + "The secret number is 4711. " + "Blocks come and go as the stream moves on. " * 6)
KNOBS = dict(block_size=8, chunk_size=48, prompt_mode="stream", granularity="head",
             sink_blocks=1, recent_blocks=1)
HEAD_METHODS = ["nexus", "knorm", "expected", "snapkv", "tova"]


def _ids(tok) -> torch.Tensor:
    return torch.tensor(tok(CONTEXT)["input_ids"])


@pytest.mark.parametrize("num_queries", [1, 5])
def test_head_mask_equals_attention_over_each_heads_own_entries(num_queries: int) -> None:
    g = torch.Generator().manual_seed(num_queries)
    hq, hkv, cached, d = 6, 2, 20, 8
    n = num_queries
    q = torch.randn(1, hq, n, d, generator=g)
    k = torch.randn(1, hkv, cached + n, d, generator=g)
    v = torch.randn(1, hkv, cached + n, d, generator=g)
    live = torch.rand(hkv, cached, generator=g) > 0.4
    mask = with_head_mask(None, live, hq, n, cached + n)
    group = hq // hkv
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask)
    for j in range(hq):  # a gather of each head's own entries, then plain causal attention
        h = j // group
        idx = torch.cat([torch.nonzero(live[h]).view(-1), torch.arange(cached, cached + n)])
        logits = q[0, j] @ k[0, h, idx].T / math.sqrt(d)
        causal = torch.ones(n, idx.numel(), dtype=torch.bool)
        causal[:, -n:] = torch.ones(n, n, dtype=torch.bool).tril()
        ref = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1) @ v[0, h, idx]
        torch.testing.assert_close(out[0, j], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", HEAD_METHODS)
def test_every_event_fits_the_head_block_budget_and_keeps_the_forced_set(model, tok,
                                                                          method: str) -> None:
    cfg = make_config(method, 64, **KNOBS)
    session = StreamingSession(model, cfg, record_events=True)
    ids = _ids(tok)
    for start in range(0, ids.numel(), 48):
        session.forward(ids[start:start + 48])
        session.evict(prefill=True)
    assert len(session.events) >= 3
    text = model.config
    heads = len(session.full_attention_layers) * text.num_key_value_heads
    pages = HeadPages.fresh(heads, 8)
    for event in session.events:
        live = event.head_live
        assert live is not None and live.shape[-1] == event.kept_positions.numel()
        assert head_blocks_held(live, 8) <= event.budget_blocks * heads
        # The server's layout takes the same choice: whole tiles per head before the
        # tail, within the same vLLM blocks.
        keep = torch.zeros(heads, event.seen, dtype=torch.bool)
        keep[:, event.kept_positions] = live.reshape(heads, -1)
        pages, _ = pages.plan_event(keep, event.seen)
        assert torch.equal(pages.live(event.seen), keep)
        assert pages.blocks_held(event.seen).numel() <= event.budget_blocks
        # Every slot still cached is held by some head; the forced set by all of them.
        assert bool(live.any(dim=1).any(dim=0).all())
        forced = forced_positions(event.kept_positions, event.seen, 8, 1, 1)
        assert bool(live[..., forced].all())
    assert session.held_tokens <= 64 + 8


def test_eviction_equals_a_full_forward_with_each_heads_mask(model, tok) -> None:
    """Streaming at head granularity == one forward over every token in which each layer
    and KV head sees exactly what it held when each chunk was fed (RoPE positions kept,
    each head's own cache)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cfg = make_config("snapkv", 48, **KNOBS)
    ids = _ids(tok)
    session = StreamingSession(model, cfg)
    n = ids.numel()
    layers, hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    visible = torch.zeros(layers, hkv, n, n, dtype=torch.bool)
    last = None
    for start in range(0, n, 48):
        end = min(start + 48, n)
        live = session.head_live
        assert live is not None
        for li in range(layers):
            for h in range(hkv):
                visible[li, h, start:end, session.positions[live[li, h]]] = True
        visible[..., start:end, start:end] = torch.ones(end - start, end - start).tril().bool()
        last = session.forward(ids[start:end], logits_to_keep=1)[-1]
        session.evict(prefill=True)
    assert session.num_events >= 3
    group = model.config.num_attention_heads // hkv

    def per_head_visible(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN202
        mask = visible[module.layer_idx].repeat_interleave(group, dim=0)[None]
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("test_per_head_visible", per_head_visible)
    reference = tiny_model("llama", vocab_size=model.config.vocab_size,
                           eos_token_id=model.config.eos_token_id)
    reference.load_state_dict(model.state_dict())
    reference.set_attn_implementation("test_per_head_visible")
    with torch.no_grad():
        out = reference(input_ids=ids[None])
    assert last is not None
    torch.testing.assert_close(last, out.logits[0, -1].float(), atol=2e-4, rtol=1e-4)


def test_a_budget_above_the_prompt_gives_dense_logits(model, tok) -> None:
    ids = _ids(tok)
    heads = StreamingSession(model, make_config("nexus", 4096, **KNOBS))
    dense = StreamingSession(model, None)
    for start in range(0, ids.numel(), 48):
        a = heads.forward(ids[start:start + 48])
        heads.evict(prefill=True)
        b = dense.forward(ids[start:start + 48])
    assert torch.equal(a, b)
    assert heads.held_tokens == ids.numel()


def test_clone_keeps_its_own_head_ledger(model, tok) -> None:
    ids = _ids(tok)
    session = StreamingSession(model, make_config("knorm", 48, **KNOBS))
    for start in range(0, 192, 48):
        session.forward(ids[start:start + 48])
        session.evict(prefill=True)
    branch = session.clone()
    branch.forward(ids[192:240])
    branch.evict(prefill=True)
    assert session.head_live is not None and branch.head_live is not None
    assert session.head_live.shape[-1] == session.cache_len
    assert branch.head_live.shape[-1] == branch.cache_len


def test_head_granularity_refuses_latent_and_sink_models(tok) -> None:
    cfg = make_config("nexus", 64, **KNOBS)
    sinks = tiny_model("gpt_oss", vocab_size=len(tok))
    with pytest.raises(ValueError, match="attention sinks"):
        StreamingSession(sinks, cfg)
    with pytest.raises(ValueError, match="MLA model caches one latent row"):
        StreamingSession(tiny_deepseek_v2(len(tok)), cfg)


def test_a_head_profile_fixes_each_heads_share(model, tok, tmp_path) -> None:
    layers, hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    shares = [[0.0] * hkv for _ in range(layers)]
    shares[1][0] = 1.0  # everything past the forced set to one head
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"model": "tiny", "budget_share": 0.2, "shares": shares}))
    session = StreamingSession(model, make_config("knorm", 64, head_profile=str(path), **KNOBS),
                               record_events=True)
    ids = _ids(tok)
    for start in range(0, ids.numel(), 48):
        session.forward(ids[start:start + 48])
        session.evict(prefill=True)
    counts = session.events[-1].head_live.sum(dim=-1)
    assert int(counts[1, 0]) == int(counts.max()) > int(counts[0, 0]) == int(counts[2, 1])
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"model": "tiny", "budget_share": 0.2, "shares": [[1.0]]}))
    with pytest.raises(ValueError, match=r"allocates over \(1, 1\)"):
        StreamingSession(model, make_config("knorm", 64, head_profile=str(wrong), **KNOBS))


# -- the learned stand-in for KVzip's reconstruction score (core/head_scorer.py) --------
def _tiny_scorer(model, path, *, weight_scale: float = 1.0, bias=None):  # noqa: ANN001, ANN202
    from nexus_vllm.core.head_scorer import HeadScorer

    text = model.config
    layers, hidden, hkv = (text.num_hidden_layers, text.hidden_size,
                           text.num_key_value_heads)
    g = torch.Generator().manual_seed(7)
    weight = weight_scale * torch.randn(layers, hidden, hkv, generator=g)
    bias = torch.randn(layers, hkv, generator=g) if bias is None else bias
    HeadScorer(model="tiny", weight=weight, bias=bias).save(path)
    return str(path)


def test_the_stand_in_scores_each_token_from_its_attention_input(model, tok, tmp_path) -> None:
    """With nothing evicted, each slot's estimate is the scorer on what the layer's
    attention read for that token in one plain forward: its input norm's output."""
    scorer_path = _tiny_scorer(model, tmp_path / "s.pt")
    cfg = make_config("reconstruction", 4096, head_scorer=scorer_path, **KNOBS)
    session = StreamingSession(model, cfg)
    ids = _ids(tok)
    for start in range(0, ids.numel(), 48):
        session.forward(ids[start:start + 48])
        session.evict(prefill=True)
    from nexus_vllm.core.head_scorer import load_head_scorer

    scorer = load_head_scorer(scorer_path)
    with torch.no_grad():
        out = model(input_ids=ids.view(1, -1), output_hidden_states=True)
    estimate = session._heads.estimate
    assert estimate is not None and estimate.shape[-1] == ids.numel()
    for li in range(model.config.num_hidden_layers):
        attn_in = model.model.layers[li].input_layernorm(out.hidden_states[li])[0]
        torch.testing.assert_close(estimate[li], scorer.score(li, attn_in),
                                   atol=1e-4, rtol=1e-4)


def test_the_stand_in_spends_the_budget_where_it_scores_highest(model, tok, tmp_path) -> None:
    """A scorer that gives every token of a head the same score (its bias): one threshold
    keeps the best-scoring head whole and the worst only its forced set."""
    layers, hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    bias = torch.arange(layers * hkv, dtype=torch.float32).view(layers, hkv)
    scorer_path = _tiny_scorer(model, tmp_path / "s.pt", weight_scale=0.0, bias=bias)
    cfg = make_config("reconstruction", 64, head_scorer=scorer_path, **KNOBS)
    session = StreamingSession(model, cfg, record_events=True)
    ids = _ids(tok)
    for start in range(0, ids.numel(), 48):
        session.forward(ids[start:start + 48])
        session.evict(prefill=True)
    event = session.events[-1]
    counts = event.head_live.sum(dim=-1)
    forced = forced_positions(event.kept_positions, event.seen, 8, 1, 1)
    assert int(counts[-1, -1]) == event.kept_positions.numel()  # the best head: all
    # The worst: the forced set before the newest token's block, packed into whole
    # head-blocks (a partial head-block's free slots cost nothing, so its best entries
    # fill them), and that block whole (the tail, the server's layout: core/head_pages).
    edge = tail_block_of(event.seen, 8) * 8
    packed = event.kept_positions < edge
    assert int(counts[0, 0]) == int(counts.min())
    assert int(counts[0, 0]) == -(-int((forced & packed).sum()) // 8) * 8 + int((~packed).sum())
    assert bool(((event.head_live[..., packed].sum(dim=-1) % 8) == 0).all())
    heads = layers * hkv
    assert head_blocks_held(event.head_live, 8) <= event.budget_blocks * heads


def test_the_stand_in_is_found_by_model_name_or_refused(model, tok, tmp_path) -> None:
    with pytest.raises(ValueError, match="none is shipped for") as err:
        StreamingSession(model, make_config("reconstruction", 64, **KNOBS))
    assert getattr(err.value, "field", None) == "head_scorer"
    wrong = tmp_path / "wrong.pt"
    from nexus_vllm.core.head_scorer import HeadScorer

    HeadScorer(model="other", weight=torch.zeros(1, 4, 1), bias=torch.zeros(1, 1)).save(wrong)
    with pytest.raises(ValueError, match="trained on other"):
        StreamingSession(model, make_config("reconstruction", 64, head_scorer=str(wrong),
                                            **KNOBS))
    # A dense session cannot become one: its tokens' attention inputs are gone.
    dense = StreamingSession(model, None, capture_rows=32)
    dense.forward(_ids(tok)[:48])
    cfg = make_config("reconstruction", 64, head_scorer=_tiny_scorer(model, tmp_path / "s.pt"),
                      **{**KNOBS, "prompt_mode": "end"})
    with pytest.raises(ValueError, match="scores tokens as they are fed"):
        dense.with_config(cfg)
