"""kvpress side by side: its own virtualenv, the same token ids as our harness."""

import pytest

from nexus_vllm.eval.peers import PEER_PRESSES, run_kvpress

pytestmark = pytest.mark.slow


def test_unknown_press_and_bad_budget_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown"):
        run_kvpress([], model="m", presses=["h2o-ish"], budgets=[0.2], python=tmp_path)
    with pytest.raises(ValueError, match="ratios"):
        run_kvpress([], model="m", presses=["snapkv"], budgets=[1.5], python=tmp_path)


def test_kvpress_presses_run_on_the_embedded_model():
    from transformers import AutoTokenizer

    from nexus_vllm.hf.generate import encode_prompt
    from nexus_vllm.models import default_model_path

    path = str(default_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. "
    context = filler * 20 + "The pass key is 71432. Remember it. " + filler * 20
    split = encode_prompt(tok, context, " What is the pass key? The pass key is", answer=" 71432")
    sample = {"key": "s0", "ids": split.ids.tolist(), "n_context": split.n_context,
              "n_prompt": split.n_prompt, "max_new_tokens": 6}
    records = run_kvpress([sample], model=path, presses=["streaming", "tova"], budgets=[0.25, 1.0])
    assert {(r["press"], r["budget"]) for r in records} == {
        (p, b) for p in ("streaming", "tova") for b in (0.25, 1.0)
    }
    for r in records:
        if r["budget"] == 1.0:  # nothing compressed: identical to dense
            assert r["kl"] < 1e-6 and abs(r["delta_loglik"]) < 1e-4
            assert r["cache_tokens"] == split.n_context
        else:
            assert r["cache_tokens"] < 0.3 * split.n_context
    # StreamingLLM keeps sinks + the recent window: the mid-context key is gone.
    low = next(r for r in records if r["press"] == "streaming" and r["budget"] == 0.25)
    assert low["kl"] > 0.01
    assert set(PEER_PRESSES) >= {"snapkv", "streaming", "tova", "knorm", "expected_attention"}
