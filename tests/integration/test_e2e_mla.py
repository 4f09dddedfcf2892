"""End to end: eviction on a multi-head latent attention (MLA) model, a tiny random
DeepSeek-V2 (``nexus_vllm.hf.tiny_mla``: latent 512 + rotary 64, 4 layers, MoE).

vLLM 0.32's CPU platform serves it with its reference MLA backend (``CPU_MLA``), with
16-token blocks and chunked prefill and prefix caching off (each prompt is computed in
one step): the ``end`` prompt mode and decode-time events run; ``stream`` is refused at
startup, naming that limit (``test_mla.py``, on vLLM's own config). One evicting server with the self-check on (each scored
layer's latent key view is checked against the rows vLLM wrote, the first scoring steps
against the torch reference). Random weights: plumbing and bounds, never quality.
~90 s on 2 cores.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import pathlib
import time

import pytest

from tests.integration.conftest import HAS_VLLM
from tests.integration.test_e2e_serve import _client, _greedy, _prompt

pytestmark = [
    pytest.mark.e2e, pytest.mark.slow,
    pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed"),
]

BLOCK = 16  # what vLLM's CPU MLA backend runs with (the plugin adopts it)
BUDGET_TOKENS = 128
POOL_BLOCKS = 300  # 4800 tokens: one --max-model-len 4096 request fits
EVICT_ARGS = ["--kv-eviction", "nexus", "--kv-budget", str(BUDGET_TOKENS),
              "--kv-eviction-seed", "7", "--num-gpu-blocks-override", str(POOL_BLOCKS)]


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory):  # noqa: ANN001, ANN201
    from nexus_vllm.hf.tiny_mla import save_tiny_deepseek_v2

    return str(save_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny_mla")))


@pytest.fixture(scope="module")
def mla_server(tiny_mla, serve_tmp):  # noqa: ANN001, ANN201
    from nexus_vllm.eval.server import VllmServer

    server = VllmServer(tiny_mla, EVICT_ARGS, serve_tmp, env={"NEXUS_VLLM_SELF_CHECK": "1"})
    yield server
    server.stop()


def test_tiny_model_is_mla(tiny_mla) -> None:  # noqa: ANN001
    cfg = json.loads((pathlib.Path(tiny_mla) / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576  # CPU_MLA's one size


def test_without_eviction_the_paths_agree(mla_server) -> None:  # noqa: ANN001
    """A budget that never binds gives the tokens of a request that opts out."""
    prompt = _prompt(60, 1)
    ref, _ = _greedy(mla_server, prompt, max_tokens=12, kv_eviction="none")
    tokens, _ = _greedy(mla_server, prompt, max_tokens=12, kv_budget=4096)
    assert tokens == ref


def test_budget_holds_and_blocks_return(mla_server) -> None:  # noqa: ANN001
    before = mla_server.metrics()
    # The server's method, and expected attention (it un-rotates the rotary channels of
    # the latent queries only) per request.
    methods = [{}, {"kv_eviction": "expected"}]
    with cf.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda i: _greedy(mla_server, _prompt(120, i), max_tokens=40,
                                               **methods[i]), range(2)))
    for tokens, usage in outs:
        assert usage.prompt_tokens > 3 * BUDGET_TOKENS
        assert len(tokens) == usage.completion_tokens == 40
    after = mla_server.metrics()
    assert after["vllm:nexus_evicted_blocks_total"] > before.get(
        "vllm:nexus_evicted_blocks_total", 0.0)
    assert after["vllm:nexus_scoring_seconds_total"] > 0.0
    assert after["vllm:nexus_live_blocks_over_budget"] <= 0
    assert after.get("vllm:nexus_faults_total", 0.0) == 0.0
    assert after["vllm:nexus_total_blocks"] == POOL_BLOCKS - 1
    assert after["vllm:nexus_free_blocks"] == after["vllm:nexus_total_blocks"]
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert after["vllm:nexus_live_blocks"] == 0.0


@pytest.mark.parametrize("xargs, field, text", [
    ({"kv_budget": "lots"}, "kv_budget", ""),
    ({"kv_prompt_mode": "stream"}, "kv_prompt_mode", "chunked prefill off"),
])
def test_bad_request_values_are_400(mla_server, xargs, field, text) -> None:  # noqa: ANN001
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        _client(mla_server).completions.create(
            model=mla_server.model, prompt="hello", max_tokens=4,
            extra_body={"vllm_xargs": xargs})
    assert err.value.status_code == 400
    assert f"vllm_xargs.{field}" in str(err.value) and text in str(err.value)


def test_cancelled_streams_return_every_block(mla_server) -> None:  # noqa: ANN001
    """Streams closed after a few tokens, past their first eviction: every block comes
    back and nothing is over budget (last: it leaves the server idle)."""
    client = _client(mla_server)
    before = mla_server.metrics()["vllm:nexus_evicted_blocks_total"]

    def cancel(i: int) -> int:
        stream = client.completions.create(model=mla_server.model, prompt=_prompt(100, 7 + i),
                                           max_tokens=200, temperature=0.0, stream=True)
        n = 0
        for _ in stream:
            n += 1
            if n == 12:
                break
        stream.close()
        return n

    with cf.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(cancel, range(2))) == [12, 12]
    # The aborts land after the streams close, and vLLM's usage gauge follows its next
    # stats: wait for both (a leak fails below, after the deadline).
    deadline = time.monotonic() + 30
    while True:
        m = mla_server.metrics()
        idle = m["vllm:nexus_live_blocks"] == 0.0 and m["vllm:kv_cache_usage_perc"] == 0.0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert m["vllm:nexus_evicted_blocks_total"] > before
    assert m["vllm:nexus_free_blocks"] == m["vllm:nexus_total_blocks"]
    assert m["vllm:kv_cache_usage_perc"] == 0.0 and m["vllm:nexus_live_blocks"] == 0.0
    assert m["vllm:nexus_live_blocks_over_budget"] <= 0
    assert m.get("vllm:nexus_faults_total", 0.0) == 0.0
