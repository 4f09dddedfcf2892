"""vLLM 0.32 on CUDA with eviction: FlashAttention, FlashInfer and Triton attention.

Each evicting server runs with ``VLLM_GPU_SYNC_CHECK=error`` (a device-to-host sync in
the hot path fails the step) and ``NEXUS_VLLM_SELF_CHECK=1`` (every scored layer's key
view is checked against the keys vLLM wrote; the first scoring steps are recomputed with
the torch reference). Checks, per backend:

* budget beyond the length: greedy tokens equal stock vLLM's (default CUDA graphs);
* ``streaming`` and ``nexus`` eviction: greedy tokens and evicted blocks equal the
  transformers path (``nexus_vllm.hf.generate_ids``) in the same dtype;
* a decode-only request (short prompt, long output) evicts under PIECEWISE graphs and
  stays within budget + one chunk;
* an explicit FULL CUDA-graph mode is refused at startup with a message;
* async scheduling on (``NexusAsyncScheduler``, two steps in flight) and off
  (``NexusScheduler``): the same greedy tokens and evicted blocks, no fault (every plan
  acknowledged), every block back.
"""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from tests.gpu.conftest import HAS_CUDA, HAS_VLLM

pytestmark = [pytest.mark.gpu, pytest.mark.e2e,
              pytest.mark.skipif(not (HAS_CUDA and HAS_VLLM), reason="needs CUDA and vllm")]

BACKENDS = ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"]
BLOCK, BUDGET, CHUNK = 32, 512, 256
GPU_FLAGS = ["--max-model-len", "8192", "--gpu-memory-utilization", "0.25",
             "--max-num-seqs", "64", "--block-size", str(BLOCK), "--dtype", "bfloat16"]
# The streaming setting: an event after every prompt chunk, the chunking the transformers
# path repeats exactly.
EVICT = ["--kv-eviction", "nexus", "--kv-budget", str(BUDGET), "--kv-prompt-mode", "stream",
         "--kv-chunk-size", str(CHUNK), "--kv-eviction-seed", "7"]
CHECK_ENV = {"VLLM_GPU_SYNC_CHECK": "error", "NEXUS_VLLM_SELF_CHECK": "1",
             "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
_TEXT = ("The lighthouse keeper wrote the tide tables by hand every evening. "
         "Ships came and went; the ledger grew. ")


def _prompt_ids(model: str, n_tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids: list[int] = tok(_TEXT * (n_tokens // 10 + 1))["input_ids"]
    return ids[:n_tokens]


def _complete(server, ids: list[int], max_tokens: int, **xargs) -> list[int]:  # noqa: ANN001, ANN003
    import requests

    body = {"model": server.model, "prompt": ids, "max_tokens": max_tokens,
            "temperature": 0.0, "return_token_ids": True}
    if xargs:
        body["vllm_xargs"] = xargs
    r = requests.post(server.base_url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    out: list[int] = r.json()["choices"][0]["token_ids"]
    return out


def _save(out_dir: pathlib.Path, name: str, data: object) -> None:
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=2))


@pytest.fixture(scope="module")
def prompts(check_model: str) -> dict[str, list[int]]:
    return {"long": _prompt_ids(check_model, 1500), "short": _prompt_ids(check_model, 256)}


@pytest.fixture(scope="module")
def stock_tokens(check_model, prompts, tmp_path_factory):  # noqa: ANN001, ANN201
    from nexus_vllm.eval.server import VllmServer

    server = VllmServer(check_model, [], tmp_path_factory.mktemp("stock"), base_flags=GPU_FLAGS,
                        startup_timeout=900)
    try:
        return _complete(server, prompts["long"], 48)
    finally:
        server.stop()


@pytest.fixture(scope="module", params=BACKENDS)
def nexus_server(request, check_model, tmp_path_factory):  # noqa: ANN001, ANN201
    from nexus_vllm.eval.server import VllmServer

    server = VllmServer(check_model, [*EVICT, "--attention-backend", request.param],
                        tmp_path_factory.mktemp(request.param), base_flags=GPU_FLAGS,
                        env=CHECK_ENV, startup_timeout=900)
    server.backend = request.param
    yield server
    server.stop()


def test_budget_beyond_length_equals_stock(nexus_server, prompts, stock_tokens,
                                           check_out) -> None:  # noqa: ANN001
    got = _complete(nexus_server, prompts["long"], 48, kv_budget=8192)  # = --max-model-len
    _save(check_out, f"equal_stock_{nexus_server.backend}", {"stock": stock_tokens, "got": got})
    assert got == stock_tokens


@pytest.mark.parametrize("method", ["streaming", "nexus"])
def test_evictions_equal_the_transformers_path(nexus_server, prompts, check_model, check_out,
                                               method) -> None:  # noqa: ANN001
    import torch
    from transformers import AutoModelForCausalLM

    from nexus_vllm.core import EvictionConfig
    from nexus_vllm.hf import generate_ids

    before = nexus_server.metrics().get("vllm:nexus_evicted_blocks_total", 0.0)
    served = _complete(nexus_server, prompts["long"], 24, kv_eviction=method)
    evicted = nexus_server.metrics()["vllm:nexus_evicted_blocks_total"] - before
    model = AutoModelForCausalLM.from_pretrained(check_model, dtype=torch.bfloat16).cuda().eval()
    cfg = EvictionConfig(method=method, max_tokens=BUDGET, chunk_size=CHUNK, seed=7,
                         block_size=BLOCK, prompt_mode="stream")
    hf_ids, session = generate_ids(model, prompts["long"], cfg, max_new_tokens=24)
    hf_evicted = sum(e.blocks_before - e.blocks_after for e in session.events)
    _save(check_out, f"hf_parity_{nexus_server.backend}_{method}",
          {"server": served, "hf": hf_ids, "evicted": evicted, "hf_evicted": hf_evicted})
    assert evicted == hf_evicted > 0
    first = next((i for i, (a, b) in enumerate(zip(served, hf_ids)) if a != b), None)
    assert served == hf_ids, f"first differing token at {first}"


def test_decode_only_request_evicts(nexus_server, prompts, check_out) -> None:  # noqa: ANN001
    import requests

    before = nexus_server.metrics()

    body = {"model": nexus_server.model, "prompt": prompts["short"], "max_tokens": 4096,
            "temperature": 0.0, "ignore_eos": True}
    r = requests.post(nexus_server.base_url + "/v1/completions", json=body, timeout=900)
    r.raise_for_status()
    assert r.json()["usage"]["completion_tokens"] == 4096
    after = nexus_server.metrics()
    events = after["vllm:nexus_eviction_events_total"] - before.get(
        "vllm:nexus_eviction_events_total", 0.0)
    _save(check_out, f"decode_only_{nexus_server.backend}",
          {"events": events, "live_blocks_peak": after["vllm:nexus_live_blocks_peak"],
           "over_budget": after["vllm:nexus_live_blocks_over_budget"]})
    assert events > 0
    assert after["vllm:nexus_live_blocks_over_budget"] <= 0
    assert after["vllm:nexus_live_blocks_peak"] <= (BUDGET + CHUNK) // BLOCK
    assert after["vllm:nexus_free_blocks"] == after["vllm:nexus_total_blocks"]


def test_full_cuda_graphs_are_refused(check_model, tmp_path) -> None:  # noqa: ANN001
    from nexus_vllm.eval.server import server_env, vllm_cmd

    out = subprocess.run(vllm_cmd(check_model, *EVICT, "-cc", '{"cudagraph_mode": "FULL"}'),
                         capture_output=True, text=True, timeout=300,
                         env=server_env(tmp_path))
    tail = (out.stdout + out.stderr)[-3000:]
    assert out.returncode != 0 and "PIECEWISE" in tail, tail


def _async_run(check_model, prompts, tmp: pathlib.Path, flag: str):  # noqa: ANN001, ANN202
    from nexus_vllm.eval.server import VllmServer

    tmp.mkdir(parents=True, exist_ok=True)
    server = VllmServer(check_model, [*EVICT, flag], tmp, base_flags=GPU_FLAGS,
                        env=CHECK_ENV, startup_timeout=900)
    try:
        tokens = [_complete(server, prompts[name], 48) for name in ("long", "short")]
        return tokens, server.metrics(), server.log_tail(100000)
    finally:
        server.stop()


def test_async_scheduling_on_and_off_evict_alike(check_model, prompts, check_out,  # noqa: ANN001
                                                 tmp_path) -> None:
    on = _async_run(check_model, prompts, tmp_path / "on", "--async-scheduling")
    off = _async_run(check_model, prompts, tmp_path / "off", "--no-async-scheduling")
    assert "NexusAsyncScheduler" in on[2] and "2 steps in flight" in on[2]
    assert "NexusAsyncScheduler" not in off[2] and "1 steps in flight" in off[2]
    keys = ("vllm:nexus_evicted_blocks_total", "vllm:nexus_eviction_events_total",
            "vllm:nexus_faults_total", "vllm:nexus_request_peak_live_blocks_sum")
    _save(check_out, "async_on_off", {
        name: {"tokens": tokens, **{k: metrics.get(k, 0.0) for k in keys}}
        for name, (tokens, metrics, _) in (("on", on), ("off", off))})
    for _, metrics, _log in (on, off):
        assert metrics["vllm:nexus_evicted_blocks_total"] > 0
        assert metrics.get("vllm:nexus_faults_total", 0.0) == 0.0  # every plan acknowledged
        assert metrics["vllm:nexus_free_blocks"] == metrics["vllm:nexus_total_blocks"]
    # A request whose event is in flight is held from the schedule until its reply is
    # applied: the same events, evictions and peaks with one step in flight or two.
    assert on[0] == off[0]
    for k in keys:
        assert on[1].get(k, 0.0) == off[1].get(k, 0.0), k
