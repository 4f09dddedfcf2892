"""scripts/stream_reconstruction.py: the reconstruction score read in ``stream`` equals the
attention transformers' own eager attention pays the context from the repeated tokens, and
reading it leaves the cache as it was."""

from __future__ import annotations

import pytest
import torch

from nexus_vllm.hf import StreamingSession, make_config
from nexus_vllm.hf.testing import tiny_model
from tests.script_module import load_script

BLOCK, CHUNK = 8, 40
REPEAT = torch.tensor([5, 6, 7])  # stands in for the instruction and the chat suffix


@pytest.fixture
def script():
    """The script's module with its patch of StreamingSession installed for one test
    (every other test sees the library's own evidence)."""
    module = load_script("scripts/stream_reconstruction.py")
    uninstall = module.install()
    yield module
    uninstall()


def _session(script, model):  # noqa: ANN001, ANN202
    script._repeat_ids[model.config.name_or_path] = REPEAT
    cfg = make_config("expected", 0.5, block_size=BLOCK, window=8, prompt_window=8,
                      skip_layers=0)
    return StreamingSession(model, cfg)


def test_first_chunk_scores_are_eager_attentions_largest_weights(script) -> None:
    """The first chunk (no sink tokens before it): each token's score is the largest
    weight any repeated token's query pays it, over a KV head's query group and the
    layers' heads, in transformers' eager attention over context + repeat."""
    torch.manual_seed(0)
    model = tiny_model("llama", layers=3, seed=0)
    ids = torch.randint(10, 260, (CHUNK,))
    session = _session(script, model)
    session.forward(ids)
    script.reconstruct(session)
    assert session.cache_len == CHUNK  # the reconstruction's entries are gone

    eager = tiny_model("llama", layers=3, seed=0)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        att = eager(torch.cat([ids, REPEAT, ids])[None], output_attentions=True).attentions
    r = len(REPEAT) + CHUNK
    for li, a in enumerate(att):  # [1, Hq, T, T]
        rows = a[0, :, -r:, :CHUNK]  # the repeat's rows on the context
        want = rows.amax(dim=1).view(2, -1, CHUNK).amax(dim=1)  # [Hkv, tokens]
        torch.testing.assert_close(session._recon_scores[li], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduce", [("max", "max"), ("mean", "mean"), ("vote", "sum")])
def test_reading_the_score_changes_no_output(script, reduce, monkeypatch) -> None:
    """A session that reconstructs at every event gives the same logits after a prompt as
    one that never does, so the score is the only thing it changes; the block scores are a
    distribution over the cached blocks."""
    monkeypatch.setattr(script, "_head_reduce", reduce[0])
    monkeypatch.setattr(script, "_layer_reduce", reduce[1])
    torch.manual_seed(1)
    model = tiny_model("llama", layers=3, seed=0)
    ids = torch.randint(10, 260, (3 * CHUNK,))
    scored, plain = _session(script, model), _session(script, model)
    for start in range(0, 2 * CHUNK, CHUNK):
        scored.forward(ids[start:start + CHUNK])
        plain.forward(ids[start:start + CHUNK])
        script.reconstruct(scored)
    weights = script.block_scores(scored)
    assert weights.shape == (-(-2 * CHUNK // BLOCK),)
    assert torch.all(weights > 0) and float(weights.sum()) == pytest.approx(1.0)
    torch.testing.assert_close(scored.forward(ids[2 * CHUNK:]), plain.forward(ids[2 * CHUNK:]))


def test_the_patch_is_undone_after_each_test() -> None:
    """Run after the tests above (file order): the fixture's teardown restored the
    library's own StreamingSession methods."""
    from nexus_vllm.hf import streaming

    assert streaming.StreamingSession.gather.__qualname__ == "StreamingSession.gather"
