"""The transformers path on a model with learned attention sinks (a tiny random gpt-oss).

transformers gives gpt-oss eager attention only (its SDPA has no sink term), so a
session switches such a model to ``CAPTURE_ATTENTION_SINKS``: the query capture, then the
model's own eager attention, sinks included. Scoring leaves the sink out (each block's
share of the row's mass over the cached keys), as the server's scorer does."""

from __future__ import annotations

import pytest
import torch

from nexus_vllm.core import EvictionConfig
from nexus_vllm.hf import StreamingSession, generate_ids, make_config
from nexus_vllm.hf.streaming import (
    CAPTURE_ATTENTION,
    CAPTURE_ATTENTION_SINKS,
    has_attention_sinks,
)
from nexus_vllm.hf.testing import TINY_SLIDING_WINDOW, tiny_model

torch.set_num_threads(1)

KNOBS = {"block_size": 8, "window": 4, "prompt_window": 8, "skip_layers": 1,
         "attention_reduce": "mean"}


def _ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 260, (n,), generator=torch.Generator().manual_seed(seed))


def _gpt_oss():  # noqa: ANN202
    return tiny_model("gpt_oss", layers=4, heads=4, kv_heads=2, head_dim=32)


def test_tiny_gpt_oss_has_sinks_windows_and_experts() -> None:
    model = _gpt_oss()
    cfg = model.config
    assert cfg.model_type == "gpt_oss" and cfg._attn_implementation == "eager"
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert cfg.sliding_window == TINY_SLIDING_WINDOW and cfg.num_local_experts > 2
    assert has_attention_sinks(model) and not has_attention_sinks(tiny_model())
    # Sinks drawn away from transformers' default, so they take a real share of the mass.
    assert model.model.layers[1].self_attn.sinks.abs().max() > 0.5


@torch.no_grad()
def test_switching_changes_no_output_and_keeps_the_sinks() -> None:
    """A session switches the eager model to the sink-aware capture: forwards without a
    session give bit-identical logits (one shot and a chunk after a past: the eager
    mask), and the sinks still count (other sinks, other logits)."""
    model = _gpt_oss()
    ids = _ids(0, 96).unsqueeze(0)  # past the 64-token window
    before = model(input_ids=ids).logits
    past = model(input_ids=ids[:, :80], use_cache=True).past_key_values
    chunked_before = model(input_ids=ids[:, 80:], past_key_values=past).logits
    StreamingSession(model, make_config("nexus", 64, **KNOBS))
    assert model.config._attn_implementation == CAPTURE_ATTENTION_SINKS
    assert torch.equal(model(input_ids=ids).logits, before)
    past = model(input_ids=ids[:, :80], use_cache=True).past_key_values
    assert torch.equal(model(input_ids=ids[:, 80:], past_key_values=past).logits,
                       chunked_before)
    for layer in model.model.layers:
        layer.self_attn.sinks.add_(3.0)
    assert not torch.allclose(model(input_ids=ids).logits, before)


def test_a_sink_model_without_eager_is_refused() -> None:
    """SDPA would drop the sinks: a gpt-oss whose config says sdpa is refused."""
    model = _gpt_oss()
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="attention sinks.*attn_implementation='eager'"):
        StreamingSession(model, make_config("nexus", 64, **KNOBS))
    assert tiny_model().config._attn_implementation == "sdpa"
    plain = tiny_model()
    StreamingSession(plain, make_config("nexus", 64, **KNOBS))
    assert plain.config._attn_implementation == CAPTURE_ATTENTION


@torch.no_grad()
def test_mass_leaves_the_sink_out_and_only_full_layers_evict() -> None:
    """The scored rows are distributions over the cached keys (the sink's share is not
    in them), only the full-attention layers are scored and evicted, and an evicting
    generation runs past the window."""
    model = _gpt_oss()
    session = StreamingSession(model, make_config("nexus", 64, **KNOBS))
    session.forward(_ids(1, 120))
    assert session.full_attention_layers == [1, 3]
    mass = session.block_mass(4)
    assert torch.allclose(mass.sum(dim=-1), torch.ones(4), atol=1e-5)

    cfg = EvictionConfig(method="nexus", max_tokens=64, chunk_size=32, block_size=8,
                         prompt_mode="stream", seed=7)
    out, session = generate_ids(model, _ids(2, 200).tolist(), cfg, max_new_tokens=16)
    assert len(out) == 16 and session.events
    assert all(e.blocks_after < e.blocks_before for e in session.events)
