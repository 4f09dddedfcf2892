"""End to end: tensor parallelism on a hybrid sliding-window model (a tiny random Gemma 3).

Two evicting servers of the same checkpoint (4 query / 2 KV heads, so each of two ranks
holds one KV head of every group), one after another: one rank, then
``--tensor-parallel-size 2`` with the multiprocess executor (gloo on CPU). Each rank
scores its query heads of the full-attention layers; the ranks' evidence is combined
over the TP group, rank 0 reports, and every rank applies the same broadcast plan to the
full-attention group while vLLM keeps each sliding group's window. So the two servers
evict the same blocks and give the same greedy tokens, each request stays within its
bound, and every block of every group comes back.

This checkpoint's keys all have the same length (Gemma's ``k_norm`` with its weights at
zero gives every key the norm sqrt(D)), so key norms tie and only rounding, which
differs between one rank and two, orders them: the key-norm prior of Nexus's ``stream``
defaults reads such norms as flat (``core.policies.KNORM_SPREAD_FLOOR``), and the test
failed without it. The ``knorm`` policy reads them as a tie too (the older blocks kept:
``core.policies.key_norms_are_flat``).

Marked ``long`` (two server starts, ~3 min on 2 cores): ``bash scripts/test.sh --long``.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import HAS_VLLM
from tests.integration.test_e2e_hybrid import EVICT_ARGS, PROMPTS, tiny_gemma3  # noqa: F401
from tests.integration.test_e2e_parallel import MP, TP_ENV
from tests.integration.test_e2e_serve import _greedy

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.long,
              pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]


def _serve(model: str, serve_tmp, extra: list[str],  # noqa: ANN001
           env: dict[str, str] | None = None) -> tuple[list[list[str]], dict[str, float]]:
    from nexus_vllm.eval.server import VllmServer

    server = VllmServer(model, EVICT_ARGS + extra, serve_tmp, env=env)
    try:
        return [_greedy(server, p)[0] for p in PROMPTS], server.metrics()
    finally:
        server.stop()


def test_tensor_parallel_hybrid_matches_one_rank(tiny_gemma3, serve_tmp) -> None:  # noqa: ANN001, F811
    one_rank_tokens, one_rank = _serve(tiny_gemma3, serve_tmp, [])
    tokens, metrics = _serve(tiny_gemma3, serve_tmp, [*MP, "--tensor-parallel-size", "2"],
                             env=TP_ENV)
    assert one_rank["vllm:nexus_evicted_blocks_total"] > 0
    for name in ("vllm:nexus_evicted_blocks_total", "vllm:nexus_eviction_events_total"):
        assert metrics[name] == one_rank[name], name
    assert tokens == one_rank_tokens
    assert metrics["vllm:nexus_live_blocks_over_budget"] <= 0
    # Every block of every group back in the pool (the gauges count the whole pool).
    assert metrics["vllm:nexus_free_blocks"] == metrics["vllm:nexus_total_blocks"]
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0
