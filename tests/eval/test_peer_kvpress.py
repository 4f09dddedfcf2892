"""kvpress side by side: its own virtualenv, the same token ids as our harness."""

import subprocess

import pytest

from nexus_vllm.eval import _kvpress_worker
from nexus_vllm.eval.peers import PEER_PRESSES, ensure_kvpress_venv, run_kvpress


def test_every_peer_press_has_a_kvpress_class() -> None:
    # The worker cannot import nexus_vllm, so it keeps its own table: the two must agree.
    assert set(_kvpress_worker.PRESS_CLASSES) == set(PEER_PRESSES)


def test_unknown_press_and_bad_budget_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown"):
        run_kvpress([], model="m", presses=["h2o-ish"], budgets=[0.2], python=tmp_path)
    with pytest.raises(ValueError, match="ratio must be in"):
        run_kvpress([], model="m", presses=["snapkv"], budgets=[1.5], python=tmp_path)
    with pytest.raises(ValueError, match="kvpress has no token budget"):
        run_kvpress([], model="m", presses=["snapkv"], budgets=[512], python=tmp_path)


# Creates a virtualenv and pip-installs kvpress, torch and transformers on first use: it
# needs a package index, hence `network` (deselect with -m "not network"; CI runs it).
@pytest.mark.slow
@pytest.mark.network
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
    # Every press we offer exists in the installed kvpress (only two ran above).
    names = sorted(_kvpress_worker.PRESS_CLASSES.values())
    check = f"import kvpress; [getattr(kvpress, n) for n in {names!r}]"
    proc = subprocess.run([str(ensure_kvpress_venv()), "-c", check], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_peer_orchestration_writes_resumable_records(tmp_path, monkeypatch):
    """``eval --peer kvpress`` without kvpress: a stand-in worker answers for every press,
    and the records land in our format, keyed like ours, resumable."""
    import json
    import sys

    from nexus_vllm.eval.peers import run_kvpress_peer
    from nexus_vllm.eval.records import read_records
    from nexus_vllm.eval.runner import RunConfig
    from nexus_vllm.hf.testing import save_tiny_checkpoint

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".nexus_vllm_kvpress").write_text("stand-in")
    calls = tmp_path / "calls"
    fake = venv / "bin" / "python"
    fake.write_text(f"""#!{sys.executable}
import json, sys
open({str(calls)!r}, "a").write("x")
job = json.load(open(sys.argv[2]))
for s in job["samples"]:
    for press in job["presses"]:
        for b in job["budgets"]:
            print(json.dumps({{"key": s["key"], "press": press, "budget": b,
                "prediction": " 123", "answer_loglik": -2.0, "dense_answer_loglik": -1.0,
                "delta_loglik": -1.0, "answer_tokens": 3, "kl": 0.5, "kl_answer": 0.25,
                "cache_tokens": 77, "seconds": 0.1}}))
""")
    fake.chmod(0o755)
    monkeypatch.setenv("NEXUS_VLLM_KVPRESS_VENV", str(venv))
    model = save_tiny_checkpoint(tmp_path / "tiny", tokenizer="byte")
    cfg = RunConfig(model=str(model), tasks=("passkey",), methods=("dense",),
                    budgets=(0.2, 512), contexts=(400,), protocols=("question-last",),
                    samples=2, seeds=1, data_seed=1)
    out = tmp_path / "run"
    records = run_kvpress_peer(cfg, out)
    assert len(records) == 2 * len(PEER_PRESSES)  # the token budget has no kvpress form
    assert read_records(out / "kvpress_records.jsonl") == records
    first = records[0]
    assert first.key == json.dumps(["passkey", 400, "question-last", 0,
                                    f"kvpress:{PEER_PRESSES[0]}", 0.2, 0])
    assert first.events == 1 and first.delta_loglik == -1.0 and first.cache_tokens == 77
    assert run_kvpress_peer(cfg, out) == records  # every sample done: the worker is not run
    assert calls.read_text() == "x"
