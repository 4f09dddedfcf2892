"""How a session captures queries: transformers' attention hook, no global session.

The session's model attends with ``CAPTURE_ATTENTION`` (registered with
``transformers.AttentionInterface``); each forward passes its own session's callback as a
keyword argument, so one session's forward cannot record into another's queries, and the
model's outputs are SDPA's for every caller."""

from __future__ import annotations

import pytest
import torch

from nexus_vllm.hf import StreamingSession, make_config
from nexus_vllm.hf.streaming import CAPTURE_ATTENTION
from nexus_vllm.hf.testing import tiny_model

torch.set_num_threads(1)

KNOBS = {"block_size": 8, "window": 4, "prompt_window": 8, "skip_layers": 1}


def _ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 260, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_switching_the_model_changes_no_output() -> None:
    """A session switches an SDPA model to the capturing implementation once; forwards
    without a session (generate, scoring) give bit-identical logits, with the SDPA mask."""
    model = tiny_model()
    ids = _ids(0, 48).unsqueeze(0)
    before = model(input_ids=ids).logits
    chunked_before = model(input_ids=ids[:, 40:], past_key_values=model(
        input_ids=ids[:, :40], use_cache=True).past_key_values).logits
    StreamingSession(model, make_config("nexus", 64, **KNOBS))
    assert model.config._attn_implementation == CAPTURE_ATTENTION
    assert torch.equal(model(input_ids=ids).logits, before)
    # A chunk after a past needs the SDPA mask (bottom-right causal), registered with it.
    chunked = model(input_ids=ids[:, 40:], past_key_values=model(
        input_ids=ids[:, :40], use_cache=True).past_key_values).logits
    assert torch.equal(chunked, chunked_before)


def test_a_forward_inside_another_records_into_its_own_session() -> None:
    """Session B's whole forward runs in the middle of session A's (as two threads could
    interleave): each session still holds exactly the queries of its own tokens. (With one
    module-level active session, B's forward took over A's capture and ended it.)"""
    model = tiny_model()
    config = make_config("nexus", 64, **KNOBS)
    ids_a, ids_b = _ids(1, 24), _ids(2, 20)

    alone_a, alone_b = StreamingSession(model, config), StreamingSession(model, config)
    logits_a, logits_b = alone_a.forward(ids_a), alone_b.forward(ids_b)

    a, b = StreamingSession(model, config), StreamingSession(model, config)
    inner: list[torch.Tensor] = []
    started: list[bool] = []

    def run_b(module: torch.nn.Module, args: object) -> None:
        if started:
            return  # B's own forward passes this layer too
        started.append(True)
        inner.append(b.forward(ids_b))

    hook = model.model.layers[1].self_attn.register_forward_pre_hook(run_b)
    try:
        outer = a.forward(ids_a)
    finally:
        hook.remove()
    assert len(inner) == 1
    assert torch.equal(outer, logits_a) and torch.equal(inner[0], logits_b)
    for layer in range(model.config.num_hidden_layers):
        for got, want in ((a, alone_a), (b, alone_b)):
            assert got._queries[layer] is not None
            assert torch.equal(got._queries[layer], want._queries[layer]), layer


def test_a_model_without_sdpa_is_refused() -> None:
    model = tiny_model()
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        StreamingSession(model, make_config("nexus", 64, **KNOBS))
