"""One realistic case: the embedded SmolLM2-135M-Instruct served with Nexus eviction at
a 256-token budget on a ~600-token chat, and ``nexus-vllm parity`` against the same
server, eviction off and on, through the completions API and the chat API (~4 min on 2
CPU cores). The module's server runs the defaults (prompt mode end), its prompts chunked
by vLLM in 128-token steps (``--max-num-batched-tokens``), the chunk the transformers path
repeats; the fast preset's server runs the streaming setting."""

from __future__ import annotations

import pytest

from tests.integration.conftest import HAS_VLLM

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]

BUDGET, CHUNK = 256, 128
FACT = "My secret number is 4721. "
FILLER = "The city of Veltra sits on a river. Its bakers rise at four. " * 30
QUESTION = " What is my secret number? Answer with the number only."


def _serve(serve_tmp, *flags: str):  # noqa: ANN001, ANN202
    """The embedded model served with ``flags``, the budget and chunk of this module."""
    try:
        from nexus_vllm.models import default_model_path

        model = str(default_model_path())
    except Exception as exc:  # the GGUF package or converter is missing
        pytest.skip(f"embedded model unavailable: {exc}")
    from nexus_vllm.eval.server import VllmServer

    return VllmServer(model, [*flags, "--kv-budget", str(BUDGET), "--kv-chunk-size",
                              str(CHUNK)], serve_tmp)


@pytest.fixture(scope="module")
def smol_server(serve_tmp):  # noqa: ANN001, ANN201
    server = _serve(serve_tmp, "--kv-eviction", "nexus", "--max-num-batched-tokens",
                    str(CHUNK))
    yield server
    server.stop()


def test_smollm2_long_chat_under_budget(smol_server) -> None:  # noqa: ANN001
    import openai

    client = openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused",
                           max_retries=0, timeout=300)
    before = smol_server.metrics()
    r = client.chat.completions.create(
        model=smol_server.model, max_tokens=24, temperature=0.0,
        messages=[{"role": "user", "content": FACT + FILLER + QUESTION}],
    )
    text = r.choices[0].message.content or ""
    assert r.usage is not None
    print(f"SmolLM2 @ {BUDGET}/{r.usage.prompt_tokens} tokens: {text!r}")
    assert r.usage.prompt_tokens > 2 * BUDGET
    assert text.strip() and r.choices[0].finish_reason in ("stop", "length")
    after = smol_server.metrics()
    assert after["vllm:nexus_evicted_blocks_total"] > before.get(
        "vllm:nexus_evicted_blocks_total", 0.0)
    assert after["vllm:nexus_live_blocks_over_budget"] <= 0
    assert after["vllm:nexus_free_blocks"] == after["vllm:nexus_total_blocks"]
    # The defaults score every layer from skip_layers = 2 on.
    assert "28 of 30 attention layers scored" in smol_server.log_path.read_text(
        errors="replace")


def _parity(smol_server, capsys, *flags: str) -> tuple[int, list[dict], dict]:  # noqa: ANN001
    """``nexus-vllm parity`` against the module's server: (exit code, rows, summary)."""
    import json

    from nexus_vllm.cli import main

    rc = main(["parity", "--base-url", smol_server.base_url, "--samples", "2",
               "--context", "512", *flags])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    return rc, [x for x in lines if "index" in x], lines[-1]["summary"]


def test_parity_dense_server_equals_transformers(smol_server, capsys) -> None:  # noqa: ANN001
    """The suite's prompts through the server reproduce the transformers path token for
    token with eviction off, so any difference at a budget comes from eviction."""
    rc, rows, summary = _parity(smol_server, capsys, "--method", "none")
    assert len(rows) == 2
    assert rc == 0 and all(r["ids_match"] for r in rows), rows
    assert all(r["server_text"] == r["hf_text"] for r in rows)
    assert all(r["server_evicted_blocks"] == r["hf_evicted_blocks"] == 0 for r in rows)
    assert summary["diff"] == 0.0


def test_parity_with_eviction_server_equals_transformers(smol_server, capsys) -> None:  # noqa: ANN001
    """With Nexus eviction on (the budget sent per request, the server's chunk size), the
    real model evicts the same blocks and gives the same token ids on both paths."""
    rc, rows, summary = _parity(smol_server, capsys, "--method", "nexus",
                                "--budget", str(BUDGET), "--chunk-size", str(CHUNK))
    assert len(rows) == 2
    assert all(r["prompt_tokens"] > BUDGET + CHUNK for r in rows)  # prefill must evict
    assert rc == 0 and all(r["ids_match"] for r in rows), rows
    assert all(r["server_evicted_blocks"] == r["hf_evicted_blocks"] > 0 for r in rows), rows
    assert summary["ids_match"] == summary["evicted_match"] == 2


def test_parity_chat_api_server_equals_transformers(smol_server, capsys) -> None:  # noqa: ANN001
    """The chat shape as a user's client sends it (document and question in one message
    to /v1/chat/completions), with the defaults: the server's rendering of the messages is
    the suite's prompt, and the answer's tokens and evicted blocks are the transformers
    path's."""
    rc, rows, summary = _parity(smol_server, capsys, "--protocol", "chat", "--task",
                                "niah_single_prose", "--context", "1024", "--method",
                                "nexus", "--budget", str(BUDGET), "--chunk-size", str(CHUNK))
    assert len(rows) == 2 and all(r["prompt_match"] for r in rows), rows
    assert rc == 0 and summary["ids_match"] == summary["evicted_match"] == 2, rows
    assert all(r["server_evicted_blocks"] > 0 for r in rows)


def test_parity_multiturn_every_turn_a_request(smol_server, capsys) -> None:  # noqa: ANN001
    """The multi-turn family as the evaluation streams it (each turn a request with the
    conversation so far) gives the same tokens and evictions on the server."""
    rc, rows, summary = _parity(smol_server, capsys, "--task", "multiturn", "--context",
                                "1200", "--samples", "1", "--method", "nexus", "--budget",
                                str(BUDGET), "--chunk-size", str(CHUNK))
    assert [r["turn"] for r in rows] == list(range(6))
    assert rc == 0 and summary["ids_match"] == summary["evicted_match"] == 6, rows
    assert sum(r["server_evicted_blocks"] for r in rows) > 0


@pytest.fixture(scope="module")
def fast_server(serve_tmp):  # noqa: ANN001, ANN201
    """The same model with the cheaper-evidence preset (16 prefill rows, every other
    layer), given as a config file as a user would."""
    import pathlib

    preset = pathlib.Path(__file__).parents[2] / "configs" / "nexus-fast.yaml"
    server = _serve(serve_tmp, "--kv-eviction-config", str(preset), "--kv-prompt-mode",
                    "stream")
    yield server
    server.stop()


def test_parity_fast_preset_scores_the_same_layers(fast_server, capsys) -> None:  # noqa: ANN001
    """With the preset the worker scores layers 2, 4, ..., 28 of SmolLM2's 30 (its startup
    log says how many), and the server matches the transformers path run with the same
    knobs: token ids and evicted-block counts. (At these lengths stride 1 and 2 happen to
    choose alike, so the layer count is checked on its own.)"""
    log = fast_server.log_path.read_text(errors="replace")
    assert "14 of 30 attention layers scored" in log, fast_server.log_tail(40)
    rc, rows, summary = _parity(fast_server, capsys, "--method", "nexus",
                                "--budget", str(BUDGET), "--chunk-size", str(CHUNK),
                                "--knobs", '{"prompt_window": 16, "layer_stride": 2, '
                                '"prompt_mode": "stream"}')
    assert rc == 0 and all(r["ids_match"] for r in rows), rows
    assert all(r["server_evicted_blocks"] == r["hf_evicted_blocks"] > 0 for r in rows), rows
    assert summary["ids_match"] == summary["evicted_match"] == 2


@pytest.mark.parametrize("mode", ["end", "stream"])
def test_prompt_modes_server_equals_transformers(smol_server, mode) -> None:  # noqa: ANN001
    """Each prompt mode per request on the default server, with the real model: ``end``
    keeps the chat whole until its last chunk, then one event (the question in its
    window) evicts to the budget; ``stream`` evicts after every chunk from the first. The
    server and the transformers path under the same config give the same tokens and
    evict the same blocks."""
    import requests
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nexus_vllm.core import EvictionConfig
    from nexus_vllm.hf import generate_ids
    from nexus_vllm.hf.generate import eos_ids

    tok = AutoTokenizer.from_pretrained(smol_server.model)
    chat = tok.apply_chat_template([{"role": "user", "content": FACT + FILLER + QUESTION}],
                                   add_generation_prompt=True, tokenize=False)
    ids = list(tok(chat, add_special_tokens=False)["input_ids"])
    assert len(ids) > 2 * BUDGET
    before = smol_server.metrics().get("vllm:nexus_evicted_blocks_total", 0.0)
    r = requests.post(smol_server.base_url + "/v1/completions", timeout=300, json={
        "model": smol_server.model, "prompt": ids, "max_tokens": 16, "temperature": 0.0,
        "return_token_ids": True,
        "vllm_xargs": {"kv_prompt_mode": mode, "kv_budget": BUDGET}})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    evicted = smol_server.metrics()["vllm:nexus_evicted_blocks_total"] - before

    model = AutoModelForCausalLM.from_pretrained(smol_server.model,
                                                 dtype=torch.float32).eval()
    cfg = EvictionConfig(method="nexus", max_tokens=BUDGET, chunk_size=CHUNK,
                         prompt_mode=mode)
    hf_ids, session = generate_ids(model, ids, cfg, max_new_tokens=16,
                                   eos_token_ids=eos_ids(model, tok))
    print(f"prompt mode {mode} @ {BUDGET}/{len(ids)} tokens: {choice['text']!r}")
    prefill_events = [e.seen for e in session.events if e.prefill]
    if mode == "end":
        assert prefill_events == [len(ids)]
    else:
        assert len(prefill_events) > 2 and prefill_events[0] < len(ids)
    assert choice["token_ids"] == hf_ids
    assert evicted == sum(e.blocks_before - e.blocks_after for e in session.events) > 0
    m = smol_server.metrics()
    assert m["vllm:nexus_live_blocks_over_budget"] <= 0
    assert m["vllm:nexus_free_blocks"] == m["vllm:nexus_total_blocks"]
