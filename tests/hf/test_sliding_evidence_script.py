"""scripts/sliding_evidence.py: the sliding-window layers' window mass, gathered on a hybrid
model's transformers path, against the attention weights transformers itself computes."""

from __future__ import annotations

import pytest
import torch

from nexus_vllm.core import combine_layer_masses
from nexus_vllm.hf import make_config
from nexus_vllm.hf.testing import TINY_SLIDING_WINDOW, tiny_model
from tests.script_module import load_script

BLOCK, WINDOW, TOKENS, CHUNK = 8, 16, 150, 50


@pytest.fixture(scope="module")
def script():
    return load_script("scripts/sliding_evidence.py")


def _eager_mass(ids: torch.Tensor, attention_reduce: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference ``[W, N]`` masses of the newest WINDOW rows from transformers' eager
    attention weights (sliding masks applied by transformers): (full layers only, all)."""
    model = tiny_model("gemma3", layers=4, seed=0)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        att = model(ids[None], output_attentions=True).attentions  # per layer [1, Hq, T, T]
    n = -(-TOKENS // BLOCK)
    masses = []
    for a in att:
        rows = torch.nn.functional.pad(a[0, :, -WINDOW:].float(), (0, n * BLOCK - TOKENS))
        per_head = rows.view(a.shape[1], WINDOW, n, BLOCK).sum(-1)
        masses.append(per_head.mean(0) if attention_reduce == "mean" else per_head.amax(0))
    full = [m for i, m in enumerate(masses) if i % 2]  # tiny gemma3: odd layers are full
    return (combine_layer_masses(full, attention_reduce),
            combine_layer_masses(masses, attention_reduce))


@pytest.mark.parametrize("attention_reduce", ["max", "mean"])
def test_sliding_mass_matches_transformers_attention(script, attention_reduce):
    torch.manual_seed(1)
    ids = torch.randint(0, 260, (TOKENS,))
    assert TOKENS - WINDOW > TINY_SLIDING_WINDOW  # the oldest rows' windows left the cache
    model = tiny_model("gemma3", layers=4, seed=0)
    cfg = make_config("nexus", 0.5, block_size=BLOCK, window=WINDOW, prompt_window=WINDOW,
                      skip_layers=0, attention_reduce=attention_reduce)
    with script.sliding_sessions(True):
        session = script.SlidingEvidenceSession(model, cfg)
        for start in range(0, TOKENS, CHUNK):  # chunks outgrow the sliding cache
            session.forward(ids[start:start + CHUNK])
    assert session.include_sliding
    full_ref, all_ref = _eager_mass(ids, attention_reduce)
    mass = session.block_mass(WINDOW)
    torch.testing.assert_close(mass, all_ref, atol=2e-5, rtol=1e-4)
    # Without the switch: today's evidence, the full-attention layers only.
    session.include_sliding = False
    torch.testing.assert_close(session.block_mass(WINDOW), full_ref, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(all_ref, full_ref, atol=1e-3)


def test_sliding_mass_adds_only_inside_the_window(script):
    """A streamed, evicting prompt: the first event's evidence with the sliding layers is
    today's outside the window (max over layers) and more inside it; the second event
    gathers over the compacted cache (mass on evicted tokens dropped)."""
    torch.manual_seed(2)
    ids = torch.randint(0, 260, (TOKENS,))
    gathered = {}
    for sliding in (False, True):
        model = tiny_model("gemma3", layers=4, seed=0)
        cfg = make_config("nexus", 0.3, block_size=BLOCK, window=WINDOW,
                          prompt_window=WINDOW, skip_layers=0, prompt_mode="stream",
                          chunk_size=CHUNK)
        with script.sliding_sessions(sliding):
            session = script.SlidingEvidenceSession(model, cfg, prompt_tokens=TOKENS)
            for chunk in ids.split([130, TOKENS - 130]):  # the first event sees 130 tokens
                session.forward(chunk)
                session.evict()
        assert len(session.events) == 2 and script.kept_blocks(session, BLOCK)
        second = session.events[1]
        assert second.mass is not None and second.mass.shape == (WINDOW, second.blocks_before)
        gathered[sliding] = session.events[0]
    today, with_sliding = gathered[False].mass, gathered[True].mass
    seen = gathered[False].seen
    # Blocks no window row can see: every token at or before seen - W - sliding window.
    last = (torch.arange(today.shape[1]) + 1) * BLOCK - 1  # each block's last position
    outside = last <= seen - WINDOW - TINY_SLIDING_WINDOW
    assert outside.any() and (~outside).any()
    torch.testing.assert_close(with_sliding[:, outside], today[:, outside])
    assert (with_sliding >= today - 1e-6).all()
    assert (with_sliding[:, ~outside] > today[:, ~outside] + 1e-4).any()


def test_sliding_sessions_restores_the_transformers_path(script):
    from transformers import AttentionInterface

    from nexus_vllm.hf import capture, streaming

    capture._register()
    before = AttentionInterface._global_mapping[streaming.CAPTURE_ATTENTION]
    with script.sliding_sessions(True):
        assert script.hf_generate.StreamingSession is script.SlidingEvidenceSession
    assert script.hf_generate.StreamingSession is streaming.StreamingSession
    assert AttentionInterface._global_mapping[streaming.CAPTURE_ATTENTION] is before


def test_summarize_pairs_the_variants_and_places_the_differing_blocks(script, tmp_path):
    import json

    from nexus_vllm.eval.records import Record, SampleId, write_records

    records, decisions = [], []
    for i in range(4):
        sid = SampleId("niah_single_prose", 2048, "question-last", i)
        for sliding, loglik in ((False, -1.0), (True, -0.5 if i < 3 else -1.0)):
            records.append(Record.build(
                sid, script.label("end", sliding), 0.2, 0, score=1.0, prediction="x",
                answers=["x"], answer_loglik=loglik, dense_answer_loglik=-1.0,
                answer_tokens=1, kl=0.0, kl_answer=0.0, prompt_tokens=1000,
                cache_tokens=200, events=1, seconds=0.0))
        # Block 2 (tokens 64..95) is out of a 100-token reach of a 1000-token prompt,
        # block 30 (960..991) in it.
        decisions.append({"task": sid.task, "index": i, "mode": "end", "kept": 7,
                          "kept_sliding": 7, "differ": 1, "differ_blocks": [2, 30]})
    write_records(tmp_path / "records.jsonl", records)
    (tmp_path / "decisions.jsonl").write_text(
        "".join(json.dumps(d) + "\n" for d in decisions))
    script.summarize(tmp_path, ["end"], reach=100)
    table = (tmp_path / "table.md").read_text()
    assert "| end | delta_loglik | +0.375" in table and "| 3/0/1 |" in table
    assert "| end | 4 | 7.0 | 1.00 | 4 | 4 of 8 |" in table
    compared = json.loads((tmp_path / "compare.json").read_text())
    assert [c["metric"] for c in compared] == ["score", "delta_loglik", "kl"]
    assert compared[1]["a"] == "nexus+sliding" and compared[1]["b"] == "nexus"
