"""kvpress side by side: its own virtualenv, the same token ids as our harness."""

import pathlib
import subprocess

import pytest

from nexus_vllm.eval import _kvpress_worker
from nexus_vllm.eval.peers import (
    DECODING_PRESSES,
    PEER_PRESSES,
    PROMPT_PRESSES,
    check_presses,
    ensure_kvpress_venv,
    run_kvpress,
)


def test_every_peer_press_has_a_kvpress_class() -> None:
    # The worker cannot import nexus_vllm, so it keeps its own table: the two must agree.
    assert set(_kvpress_worker.PRESS_CLASSES) == set(PROMPT_PRESSES)
    assert set(_kvpress_worker.DECODING_PRESSES) == set(DECODING_PRESSES)
    assert PEER_PRESSES == PROMPT_PRESSES + DECODING_PRESSES


# kvpress 0.5.5's class of each name (read from the wheel: kvpress/__init__.py).
_CLASSES = {
    "snapkv": ("SnapKVPress", None),
    "streaming": ("StreamingLLMPress", None),
    "tova": ("TOVAPress", None),
    "knorm": ("KnormPress", None),
    "expected_attention": ("ExpectedAttentionPress", None),
    "kvzip": ("KVzipPress", None),
    "decoding_snapkv": ("DecodingPress", "SnapKVPress"),
    "decoding_streaming": ("DecodingPress", "StreamingLLMPress"),
    "decoding_tova": ("DecodingPress", "TOVAPress"),
    "decoding_knorm": ("DecodingPress", "KnormPress"),
    "decoding_expected_attention": ("DecodingPress", "ExpectedAttentionPress"),
}


@pytest.fixture
def fake_kvpress(monkeypatch):
    """A stand-in ``kvpress`` module: each class records its constructor's arguments."""
    import sys
    import types

    module = types.ModuleType("kvpress")

    def press_class(name):
        def init(self, **kwargs):
            self.kwargs = kwargs
        return type(name, (), {"__init__": init})

    for cls, base in _CLASSES.values():
        for n in (cls, base):
            if n is not None:
                setattr(module, n, press_class(n))
    monkeypatch.setitem(sys.modules, "kvpress", module)
    return module


@pytest.mark.parametrize("name", PEER_PRESSES)
def test_each_name_makes_its_kvpress_press(name, fake_kvpress):
    cls, base = _CLASSES[name]
    assert _kvpress_worker.press_spec(name) == (cls, base)
    press = _kvpress_worker._make_press(name, 0.25, 1000, 1000)
    assert type(press).__name__ == cls
    if base is None:  # every knob at kvpress's default but the ratio
        assert press.kwargs == {"compression_ratio": 0.75}
    else:  # a ratio keeps that share of the tokens before the answer; a count is the size
        assert set(press.kwargs) == {"base_press", "target_size"}
        assert type(press.kwargs["base_press"]).__name__ == base
        assert press.kwargs["base_press"].kwargs == {}
        assert press.kwargs["target_size"] == 250
        assert _kvpress_worker._make_press(name, 512, 1000, 1000).kwargs["target_size"] == 512


def test_a_token_budget_sets_each_prompt_press_ratio_from_its_context(fake_kvpress):
    """kvpress's prompt presses take a ratio only: a token budget keeps that many of the
    sample's context tokens (our runs' budgets pair with the peer's)."""
    assert _kvpress_worker.compression_ratio(0.25, 2000) == 0.75
    assert _kvpress_worker.compression_ratio(416, 2000) == 0.792
    assert _kvpress_worker.compression_ratio(4096, 2000) == 0.0  # the context fits
    press = _kvpress_worker._make_press("expected_attention", 416, 2050, 2000)
    assert press.kwargs == {"compression_ratio": 0.792}


def test_unknown_press_and_bad_budget_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"unknown; choose from \['snapkv'.*'kvzip'"):
        run_kvpress([], model="m", presses=["h2o-ish"], budgets=[0.2], python=tmp_path)
    with pytest.raises(ValueError, match="unknown"):
        check_presses(["knorm", "KVzip"])
    with pytest.raises(ValueError, match="ratio must be in"):
        run_kvpress([], model="m", presses=["snapkv"], budgets=[1.5], python=tmp_path)
    with pytest.raises(ValueError, match="positive token count"):
        run_kvpress([], model="m", presses=["decoding_knorm"], budgets=[0], python=tmp_path)
    # A sample's own presses and budgets are checked too.
    with pytest.raises(ValueError, match="positive token count"):
        run_kvpress([{"key": "s", "presses": ["snapkv"], "budgets": [-3]}], model="m",
                    python=tmp_path)
    with pytest.raises(ValueError, match="unknown"):
        run_kvpress([{"key": "s", "presses": ["nope"], "budgets": [0.2]}], model="m",
                    python=tmp_path)
    with pytest.raises(ValueError, match="no presses or budgets"):
        run_kvpress([{"key": "s"}], model="m", python=tmp_path)
    with pytest.raises(ValueError, match="unknown"):
        _kvpress_worker.press_spec("decoding_kvzip")  # KVzip is no scorer press


# Creates a virtualenv and pip-installs kvpress and its transformers on first use: it
# needs a package index, hence `network`. About 3.5 minutes with the install, for an
# evaluation tool rather than the product: the `long` tier (bash scripts/test.sh --long).
@pytest.mark.slow
@pytest.mark.network
@pytest.mark.long
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
    # The same tokens as a long generation's: the question fed as decode steps under a
    # DecodingPress (too few steps for kvpress's 512-step interval: only the protocol).
    decode = {**sample, "key": "s1", "feed": "decode", "presses": ["decoding_knorm"],
              "budgets": [1.0]}
    presses = ("streaming", "tova", "kvzip")
    records = run_kvpress([sample, decode], model=path, presses=presses, budgets=[0.25, 1.0])
    assert {(r["key"], r["press"], r["budget"]) for r in records} == {
        ("s0", p, b) for p in presses for b in (0.25, 1.0)} | {("s1", "decoding_knorm", 1.0)}
    for r in records:
        if r["budget"] == 1.0:  # nothing compressed: identical to dense
            assert r["kl"] < 1e-6 and abs(r["delta_loglik"]) < 1e-4
            n = split.n_prompt if r["key"] == "s1" else split.n_context
            assert r["cache_tokens"] == n
        else:  # KVzip masks keys per head instead of shrinking the cache: counted too
            assert r["cache_tokens"] < 0.3 * split.n_context
            assert r["events"] == 1
    assert next(r for r in records if r["key"] == "s1")["events"] == 0
    # StreamingLLM keeps sinks + the recent window: the mid-context key is gone.
    low = next(r for r in records if r["press"] == "streaming" and r["budget"] == 0.25)
    assert low["kl"] > 0.01
    # Every press we offer is made by the worker from the installed kvpress (its class
    # names and constructor arguments), at a ratio and, for decoding presses, a count.
    check = ("import _kvpress_worker as w\n"
             f"for n in {list(PEER_PRESSES)!r}:\n"
             "    w._make_press(n, 0.5, 100, 100)\n"
             "    if n.startswith(w.DECODING_PREFIX): w._make_press(n, 64, 100, 100)\n")
    proc = subprocess.run([str(ensure_kvpress_venv()), "-c", check], capture_output=True,
                          text=True, timeout=300, cwd=pathlib.Path(_kvpress_worker.__file__).parent)
    assert proc.returncode == 0, proc.stderr


def test_peer_orchestration_writes_resumable_records(tmp_path, monkeypatch):
    """``eval --peer kvpress`` without kvpress: a stand-in worker answers for every press,
    and the records land in our format, keyed like ours, resumable per press: prompt
    presses on the one-prompt task and decoding presses on the long generation, each at
    both budgets, nothing on the multi-turn chat."""
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
job = json.load(open(sys.argv[2]))
log = [[s["key"], s.get("feed", "chunk"), s["presses"], s["budgets"]] for s in job["samples"]]
open({str(calls)!r}, "a").write(json.dumps(log) + "\\n")
for s in job["samples"]:
    for press in s.get("presses", job["presses"]):
        for b in s.get("budgets", job["budgets"]):
            print(json.dumps({{"key": s["key"], "press": press, "budget": b,
                "prediction": " 123", "answer_loglik": -2.0, "dense_answer_loglik": -1.0,
                "delta_loglik": -1.0, "answer_tokens": 3, "kl": 0.5, "kl_answer": 0.25,
                "cache_tokens": 77, "events": 3 if s.get("feed") == "decode" else 1,
                "seconds": 0.1}}))
""")
    fake.chmod(0o755)
    monkeypatch.setenv("NEXUS_VLLM_KVPRESS_VENV", str(venv))
    # The trained tokenizer's chat template: the long generation needs one (and 7k tokens).
    model = save_tiny_checkpoint(tmp_path / "tiny")
    cfg = RunConfig(model=str(model), tasks=("passkey", "longgen", "multiturn"),
                    methods=("dense",), budgets=(0.2, 512), contexts=(7000,),
                    protocols=("question-last",), samples=2, seeds=1, data_seed=1)
    out = tmp_path / "run"
    # First without KVzip (as runs before it existed), then with every press.
    before = [p for p in PEER_PRESSES if p != "kvzip"]
    records = run_kvpress_peer(cfg, out, presses=before)
    assert len(records) == 2 * (len(PROMPT_PRESSES) - 1) * 2 + 2 * len(DECODING_PRESSES) * 2
    records = run_kvpress_peer(cfg, out)
    assert read_records(out / "kvpress_records.jsonl") == records
    assert len(records) == 2 * len(PROMPT_PRESSES) * 2 + 2 * len(DECODING_PRESSES) * 2
    assert len({r.key for r in records}) == len(records)
    # Both budgets for every press (a prompt press's ratio from a token budget is set per
    # sample, by the worker); multi-turn has no protocol.
    assert {(r.task, r.method.removeprefix("kvpress:"), r.budget) for r in records} == {
        *(("passkey", p, b) for p in PROMPT_PRESSES for b in (0.2, 512)),
        *(("longgen", p, b) for p in DECODING_PRESSES for b in (0.2, 512))}
    first = records[0]
    assert first.key == json.dumps(["passkey", 7000, "question-last", 0,
                                    f"kvpress:{PEER_PRESSES[0]}", 0.2, 0])
    assert first.events == 1 and first.delta_loglik == -1.0 and first.cache_tokens == 77
    gen = next(r for r in records if r.task == "longgen")
    assert gen.events == 3 and gen.turn_scores == (gen.score,)
    assert gen.turn_delta_loglik == (-1.0,)
    assert run_kvpress_peer(cfg, out) == records  # every sample done: the worker is not run
    first_call, second_call = (json.loads(line) for line in calls.read_text().splitlines())
    # The long generation's samples are fed as decode steps with the decoding presses.
    assert {(feed, tuple(presses), tuple(budgets)) for _, feed, presses, budgets
            in first_call} == {("chunk", tuple(before[:len(PROMPT_PRESSES) - 1]), (0.2, 512)),
                               ("decode", DECODING_PRESSES, (0.2, 512))}
    # Resumed: only the missing press, only where it applies.
    assert [(feed, presses) for _, feed, presses, _ in second_call] == [
        ("chunk", ["kvzip"])] * 2


def test_eval_cli_picks_peer_presses_and_rejects_unknown_ones(tmp_path, monkeypatch):
    from nexus_vllm.eval import peers
    from nexus_vllm.eval.cli import main

    base = ["--tasks", "passkey", "--methods", "dense", "--out", str(tmp_path / "run")]
    # A typo fails at startup, naming the choices, before any model is loaded.
    with pytest.raises(SystemExit, match=r"\['kvzp'\] unknown; choose from \['snapkv'"):
        main([*base, "--peer", "kvpress", "--peer-presses", "kvzip,kvzp"])
    with pytest.raises(SystemExit, match="--peer-presses needs --peer kvpress"):
        main([*base, "--peer-presses", "kvzip"])
    asked = []
    monkeypatch.setattr(peers, "run_kvpress_peer",
                        lambda cfg, out, presses=None: asked.append(presses) or [])
    main([*base, "--report-only", "--peer", "kvpress", "--peer-presses",
          "kvzip,decoding_expected_attention"])
    main([*base, "--report-only", "--peer", "kvpress"])
    assert asked == [["kvzip", "decoding_expected_attention"], None]
