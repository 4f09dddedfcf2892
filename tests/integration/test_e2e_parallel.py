"""End to end across process boundaries: the multiprocess executor, tensor parallelism
(gloo on CPU), data parallelism, plus a scoring failure on one rank.

Five servers of the tiny model, one after another (~4 min on 2 CPU cores):

1. the in-process (``uni``) executor: the reference;
2. the multiprocess executor: plans and replies are pickled between engine core and
   worker, so they must survive the process boundary;
3. ``--tensor-parallel-size 2``: each rank scores its query heads, the masses are summed
   over ranks, rank 0 reports; every rank applies the same broadcast plan;
4. the same with scoring failing on rank 1 at every event: no deadlock, no event applied,
   nothing freed by eviction, and the failure counted;
5. ``--data-parallel-size 2``: two engine cores, each with its own scheduler, budgets and
   eviction state; concurrent requests spread over both, per-request ``vllm_xargs`` reach
   the rank that serves the request, ``/metrics`` shows each rank (``engine`` label).

Pipeline parallelism is refused (see ``engine_policy``); its cross-stage scoring is
tested with gloo groups in ``test_pp_reduction.py`` and its end-to-end test waits in
``tests/compat/test_vllm034_parallel.py``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.conftest import HAS_VLLM

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]

ARGS = ["--kv-eviction", "nexus", "--kv-budget", "256", "--kv-prompt-mode", "stream",
        "--kv-chunk-size", "128",
        "--kv-eviction-seed", "7", "--num-gpu-blocks-override", "160", "--block-size", "32"]
MP = ["--distributed-executor-backend", "mp"]
# Two ranks on a 2-core box: one core each (vLLM's NUMA auto-binding needs 2 nodes).
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
_WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima"]
PROMPTS = [" ".join(_WORDS[(i * k) % 12] for i in range(n)) for k, n in ((7, 700), (5, 450))]


def _run(server) -> tuple[list[list[str]], dict[str, float]]:  # noqa: ANN001
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0,
                           timeout=300)
    tokens = []
    for prompt in PROMPTS:
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=48,
                                      temperature=0.0, logprobs=1)
        tokens.append(r.choices[0].logprobs.tokens)
    return tokens, server.metrics()


def _serve(tiny_model, serve_tmp, extra: list[str], env: dict[str, str] | None = None):  # noqa: ANN001, ANN202
    from nexus_vllm.eval.server import VllmServer

    server = VllmServer(tiny_model, ARGS + extra, serve_tmp, env=env)
    try:
        return _run(server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(tiny_model, serve_tmp):  # noqa: ANN001, ANN201
    return _serve(tiny_model, serve_tmp, [])


def _assert_evicted_and_all_freed(metrics: dict[str, float]) -> None:
    assert metrics["vllm:nexus_evicted_blocks_total"] > 0
    assert metrics["vllm:nexus_live_blocks_over_budget"] <= 0
    assert metrics["vllm:nexus_free_blocks"] == metrics["vllm:nexus_total_blocks"]


@pytest.mark.long  # CI time: tensor parallelism stays in CI
def test_multiprocess_executor(tiny_model, serve_tmp, reference) -> None:  # noqa: ANN001
    tokens, metrics = _serve(tiny_model, serve_tmp, MP,
                             env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    _assert_evicted_and_all_freed(metrics)
    assert metrics["vllm:nexus_evicted_blocks_total"] == reference[1][
        "vllm:nexus_evicted_blocks_total"]
    assert tokens == reference[0]


def test_tensor_parallel_matches_one_rank(tiny_model, serve_tmp, reference) -> None:  # noqa: ANN001
    tokens, metrics = _serve(tiny_model, serve_tmp, [*MP, "--tensor-parallel-size", "2"],
                             env=TP_ENV)
    _assert_evicted_and_all_freed(metrics)
    # The masses are the mean over all query heads either way (summed over ranks here),
    # so the same blocks are evicted and greedy decoding gives the same tokens.
    assert metrics["vllm:nexus_evicted_blocks_total"] == reference[1][
        "vllm:nexus_evicted_blocks_total"]
    assert metrics["vllm:nexus_eviction_events_total"] == reference[1][
        "vllm:nexus_eviction_events_total"]
    assert tokens == reference[0]


@pytest.mark.long  # CI time: tensor parallelism stays in CI
def test_scoring_failure_on_one_rank(tiny_model, serve_tmp) -> None:  # noqa: ANN001
    tokens, metrics = _serve(tiny_model, serve_tmp, [*MP, "--tensor-parallel-size", "2"],
                             env={**TP_ENV, "NEXUS_VLLM_FAULTS": "score_error@1"})
    assert all(len(t) == 48 for t in tokens)  # served, no deadlock
    assert metrics.get("vllm:nexus_evicted_blocks_total", 0.0) == 0.0  # nothing applied
    assert metrics["vllm:nexus_faults_total"] > 0  # score_error_peer, seen by rank 0
    assert metrics["vllm:nexus_free_blocks"] == metrics["vllm:nexus_total_blocks"]


def _per_engine(base_url: str, name: str) -> dict[str, float]:
    """``name`` per ``engine`` label on a server's /metrics (summed over other labels)."""
    import requests

    from nexus_vllm.eval.metrics_text import parse_metrics

    text = requests.get(base_url + "/metrics", timeout=10).text
    return parse_metrics(text).by_label(name, "engine")


def _concurrent(server, xargs: dict[str, object] | None) -> list[int]:  # noqa: ANN001
    """The long prompts, twice each, all at once (so both DP ranks get work)."""
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0,
                           timeout=600)

    def one(prompt: str) -> int:
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=16,
                                      temperature=0.0,
                                      extra_body={"vllm_xargs": xargs} if xargs else None)
        return int(r.usage.completion_tokens)

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, PROMPTS * 2))


@pytest.mark.long  # CI time: tensor parallelism stays in CI
def test_data_parallel_ranks_each_evict(tiny_model, serve_tmp) -> None:  # noqa: ANN001
    from nexus_vllm.eval.server import VllmServer

    # One API server: vLLM starts one per DP rank by default, and those extra API server
    # processes do not see the eviction config (a request's vllm_xargs is then refused).
    server = VllmServer(tiny_model, ARGS + [*MP, "--data-parallel-size", "2",
                                            "--api-server-count", "1"], serve_tmp,
                        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    try:
        # A per-request budget above every prompt: the rank serving it must not evict.
        assert _concurrent(server, {"kv_budget": 4096}) == [16] * 4
        assert sum(_per_engine(server.base_url,
                               "vllm:nexus_evicted_blocks_total").values()) == 0
        # The server's budget: both ranks served requests, and both evicted.
        assert _concurrent(server, None) == [16] * 4
        served = _per_engine(server.base_url, "vllm:request_success_total")
        assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()), served
        evicted = _per_engine(server.base_url, "vllm:nexus_evicted_blocks_total")
        assert set(evicted) == {"0", "1"} and all(n > 0 for n in evicted.values()), evicted
        # A tighter per-request budget holds on whichever rank serves it.
        assert _concurrent(server, {"kv_budget": 192}) == [16] * 4
        over = _per_engine(server.base_url, "vllm:nexus_live_blocks_over_budget")
        assert set(over) == {"0", "1"} and max(over.values()) <= 0, over
        # Every block back in both pools; vLLM's own KV usage is 0 on both ranks.
        free = _per_engine(server.base_url, "vllm:nexus_free_blocks")
        total = _per_engine(server.base_url, "vllm:nexus_total_blocks")
        assert free == total and set(free) == {"0", "1"}, (free, total)
        usage = _per_engine(server.base_url, "vllm:kv_cache_usage_perc")
        assert usage == {"0": 0.0, "1": 0.0}, usage
    finally:
        server.stop()
