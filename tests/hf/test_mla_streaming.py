"""Streaming eviction on multi-head latent attention (a tiny random DeepSeek-V2).

transformers' DeepSeek-V2 caches the latent (``c_kv`` as the cache layer's keys, the
rotated ``k_pe`` as its values) and expands per-head keys from it at every forward. The
session scores the latent rows with latent queries, as the vLLM plugin does
(``nexus_vllm/hf/mla.py``); the reference is the same evidence gathered from the
expanded per-head keys and the queries attention received.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nexus_vllm.core import EvictionConfig, evidence_kind
from nexus_vllm.core.evidence import DenseLayer, DenseSequence
from nexus_vllm.hf import StreamingSession, generate_ids
from nexus_vllm.hf.tiny_mla import tiny_deepseek_v2

torch.set_num_threads(1)

KNOBS = {"block_size": 8, "recent_blocks": 2, "interval": 4, "window": 4,
         "prompt_window": 8, "skip_layers": 1, "prompt_mode": "end"}


@pytest.fixture(scope="module")
def deepseek(tok) -> Any:  # noqa: ANN001
    model = tiny_deepseek_v2(len(tok), layers=3, eos_token_id=tok.eos_token_id)
    model.config._attn_implementation = "sdpa"
    return model


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g)


def test_dense_session_equals_model_generate(deepseek) -> None:  # noqa: ANN001
    """The latent capture changes nothing the model computes."""
    ids = _ids(120)
    ref = deepseek.generate(ids[None], attention_mask=torch.ones(1, 120, dtype=torch.long),
                            max_new_tokens=12, do_sample=False)[0, 120:].tolist()
    dense, _ = generate_ids(deepseek, ids.tolist(), None, max_new_tokens=12)
    assert dense == ref
    never = EvictionConfig(method="nexus", max_tokens=1024, **KNOBS)
    got, session = generate_ids(deepseek, ids.tolist(), never, max_new_tokens=12)
    assert got == ref and not session.events and session._latent


def _scored_session(deepseek: Any, monkeypatch: Any, method: str
                    ) -> tuple[StreamingSession, dict[int, torch.Tensor], int]:
    """A session fed 90 tokens, and the queries attention received per layer."""
    import nexus_vllm.hf.capture as capture

    raw: dict[int, torch.Tensor] = {}
    latent_query = capture.latent_query

    def recording(module: Any, query: torch.Tensor) -> torch.Tensor:
        prev = raw.get(int(module.layer_idx))
        q = query[0].detach()  # [N, n, D]
        raw[int(module.layer_idx)] = q if prev is None else torch.cat([prev, q], dim=1)
        return latent_query(module, query)

    monkeypatch.setattr(capture, "latent_query", recording)
    session = StreamingSession(deepseek, EvictionConfig(method=method, max_tokens=48,
                                                        **KNOBS))
    session.forward(_ids(90, 1))
    return session, raw, 8


def _per_head_sequence(deepseek: Any, session: StreamingSession, raw: dict[int, torch.Tensor],
                       w: int, rotary: Any = None) -> DenseSequence:
    """The scored layers' queries as attention received them and the per-head keys
    transformers expands from the cached latent rows."""
    cfg = session.config
    assert cfg is not None
    layers = []
    for li in session._scored_layers():
        cached = session.cache.layers[li]
        attn = deepseek.model.layers[li].self_attn
        keys, _ = attn.expand_kv(cached.keys, cached.values)  # [1, N, T, qk_head_dim]
        layers.append(DenseLayer(queries=raw[li][:, -w:].transpose(0, 1),
                                 keys=keys[0].transpose(0, 1)))
    return DenseSequence(layers=layers, block_size=cfg.block_size,
                         attention_reduce=cfg.attention_reduce,
                         query_positions=torch.arange(session.seen - w, session.seen),
                         next_position=session.seen, rotary=rotary)


def test_latent_scores_equal_per_head_scores(deepseek, monkeypatch) -> None:  # noqa: ANN001
    """Mass from the latent queries against the latent rows equals mass from the queries
    attention received against the per-head keys transformers expands from the same rows
    (``q . k_h == latent(q) . [c_kv | k_pe]``, same scale)."""
    session, raw, w = _scored_session(deepseek, monkeypatch, "h2o")
    got = session.gather(frozenset({"mass"}), w)["mass"]
    with torch.no_grad():
        want = evidence_kind("mass").gather_dense(_per_head_sequence(deepseek, session, raw, w))
    assert session.config is not None
    cfg = session.config
    assert got.shape == want.shape == (w, -(-session.seen // cfg.block_size))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_every_method_evicts_to_budget(deepseek) -> None:  # noqa: ANN001
    for method in ("nexus", "h2o", "snapkv", "tova", "knorm", "random", "streaming",
                   "expected"):
        cfg = EvictionConfig(method=method, max_tokens=48, **KNOBS)
        _, session = generate_ids(deepseek, _ids(150, 2).tolist(), cfg, max_new_tokens=16)
        assert session.events and session.cache_len <= 48 + cfg.interval + cfg.block_size
        layer = session.cache.layers[0]
        assert layer.keys.shape[-2] == layer.values.shape[-2] == session.cache_len


def test_expected_attention_from_latent_equals_per_head(deepseek, monkeypatch) -> None:  # noqa: ANN001
    """Expected attention un-rotates the latent queries' last ``qk_rope_head_dim``
    channels only; it equals expected attention over the per-head queries and keys, whose
    rotary channels are their last ``qk_rope_head_dim`` too (the statistics are linear
    maps of each other)."""
    from nexus_vllm.core import Rotary

    session, raw, w = _scored_session(deepseek, monkeypatch, "expected")
    got = session.gather(frozenset({"expected_attention"}), w)["expected_attention"]
    cfg = deepseek.config
    lat = session.rotary()
    assert (lat.offset, lat.head_size, lat.neox) == (cfg.kv_lora_rank, cfg.kv_lora_rank
                                                      + cfg.qk_rope_head_dim, False)
    head = Rotary(lat.cos_sin, neox=False, head_size=cfg.qk_nope_head_dim
                  + cfg.qk_rope_head_dim, offset=cfg.qk_nope_head_dim)
    with torch.no_grad():
        want = evidence_kind("expected_attention").gather_dense(
            _per_head_sequence(deepseek, session, raw, w, head))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    _, evicted = generate_ids(deepseek, _ids(150, 3).tolist(),
                              EvictionConfig(method="expected", max_tokens=48, **KNOBS),
                              max_new_tokens=8)
    assert evicted.events
