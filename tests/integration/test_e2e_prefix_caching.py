"""Prefix caching stays on with eviction (~2 min on 2 CPU cores).

Requests share a long prefix; some evict with a small budget, some do not:

* every non-evicting request gives exactly the tokens it gives alone on a stock server,
  also while evicting requests run beside it and after they published blocks;
* an evicting request gives the same tokens with prefix caching on and off;
* the shared part is served from the prefix cache (vLLM's own hit counters).

Three servers of the tiny model, one after another: stock (prefix caching on), evicting
with prefix caching on, evicting with it off.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from tests.integration.conftest import HAS_VLLM

# long: CI time (the tiny Gemma 3's e2e module covers prefix caching with eviction in CI).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.long,
              pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]

EVICT = ["--kv-eviction", "nexus", "--kv-budget", "256", "--kv-prompt-mode", "stream",
         "--kv-chunk-size", "128",
         "--kv-eviction-seed", "7"]
COMMON = ["--block-size", "32", "--num-gpu-blocks-override", "400"]
_WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima"]


def _text(n: int, k: int) -> str:
    return " ".join(_WORDS[(i * k) % 12] for i in range(n))


PREFIX = _text(500, 7)  # ~1.7k tokens: evicting requests first evict after 384 tokens
PLAIN = [PREFIX + " " + _text(30 + 5 * i, 5) for i in range(3)]  # kv_eviction none
EVICTING = [PREFIX + " " + _text(40 + 7 * i, 11) for i in range(2)]


def _greedy(server, prompt: str, **xargs) -> list[str]:  # noqa: ANN001, ANN003
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0,
                           timeout=300)
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=32,
                                  temperature=0.0, logprobs=1,
                                  extra_body={"vllm_xargs": xargs} if xargs else None)
    return list(r.choices[0].logprobs.tokens)


def _serve(tiny_model, serve_tmp, args):  # noqa: ANN001, ANN202
    from nexus_vllm.eval.server import VllmServer

    return VllmServer(tiny_model, [*COMMON, *args], serve_tmp)


@pytest.fixture(scope="module")
def stock(tiny_model, serve_tmp):  # noqa: ANN001, ANN201
    server = _serve(tiny_model, serve_tmp, [])
    try:
        return [_greedy(server, p) for p in PLAIN]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def evicting_without_cache(tiny_model, serve_tmp, stock):  # noqa: ANN001, ANN201
    server = _serve(tiny_model, serve_tmp, [*EVICT, "--no-enable-prefix-caching"])
    try:
        return [_greedy(server, p) for p in EVICTING]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cached(tiny_model, serve_tmp, evicting_without_cache):  # noqa: ANN001, ANN201
    server = _serve(tiny_model, serve_tmp, EVICT)
    yield server
    server.stop()


def test_prefix_caching_with_eviction(cached, stock, evicting_without_cache) -> None:  # noqa: ANN001
    before = cached.metrics()
    # An evicting request first: it publishes its clean blocks (up to its first eviction).
    first = _greedy(cached, EVICTING[0])
    assert first == evicting_without_cache[0]
    # Non-evicting requests alone, then beside evicting ones: exactly stock tokens.
    for prompt, ref in zip(PLAIN, stock):
        assert _greedy(cached, prompt, kv_eviction="none") == ref
    with cf.ThreadPoolExecutor(5) as pool:
        plain = [pool.submit(_greedy, cached, p, kv_eviction="none") for p in PLAIN]
        evicting = [pool.submit(_greedy, cached, p) for p in EVICTING]
        assert [f.result() for f in plain] == stock
        # Evicting requests (now starting from prefix hits) give the tokens they give
        # with prefix caching off.
        assert [f.result() for f in evicting] == evicting_without_cache
    after = cached.metrics()
    hits = after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total",
                                                              0.0)
    assert hits >= 384 * len(PLAIN)  # at least the evicting request's clean blocks
    assert after["vllm:nexus_evicted_blocks_total"] > 0
    assert after["vllm:nexus_free_blocks"] == after["vllm:nexus_total_blocks"]
