"""End to end across process boundaries: the multiprocess executor and tensor
parallelism (gloo on CPU), plus a scoring failure on one rank.

Four servers of the tiny model, one after another (~3 min on 2 CPU cores):

1. the in-process (``uni``) executor: the reference;
2. the multiprocess executor: plans and replies are pickled between engine core and
   worker, so they must survive the process boundary;
3. ``--tensor-parallel-size 2``: each rank scores its query heads, the masses are summed
   over ranks, rank 0 reports; every rank applies the same broadcast plan;
4. the same with scoring failing on rank 1 at every event: no deadlock, no event applied,
   nothing freed by eviction, and the failure counted.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import HAS_VLLM

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]

ARGS = ["--kv-eviction", "nexus", "--kv-budget", "256", "--kv-chunk-size", "128",
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


def test_scoring_failure_on_one_rank(tiny_model, serve_tmp) -> None:  # noqa: ANN001
    tokens, metrics = _serve(tiny_model, serve_tmp, [*MP, "--tensor-parallel-size", "2"],
                             env={**TP_ENV, "NEXUS_VLLM_FAULTS": "score_error@1"})
    assert all(len(t) == 48 for t in tokens)  # served, no deadlock
    assert metrics.get("vllm:nexus_evicted_blocks_total", 0.0) == 0.0  # nothing applied
    assert metrics["vllm:nexus_faults_total"] > 0  # score_error_peer, seen by rank 0
    assert metrics["vllm:nexus_free_blocks"] == metrics["vllm:nexus_total_blocks"]
