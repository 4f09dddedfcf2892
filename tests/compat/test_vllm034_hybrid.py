"""vLLM 0.34 end to end on a hybrid sliding-window model (the tiny random Gemma 3 of
``tests/integration/test_e2e_hybrid.py``): 0.34's grouping (``kv_cache_planning``) and
its standalone CPU runner's per-group host tables, with eviction on the full-attention
group only. The main suite's hybrid checks, imported and run unchanged."""

from __future__ import annotations

import pytest

from tests.compat._marks import VLLM034

pytestmark = VLLM034

from tests.integration.test_e2e_hybrid import (  # noqa: E402, F401
    EVICT_ARGS,
    test_bad_value_is_400_and_server_keeps_serving,
    test_full_group_evicts_within_its_bound,
    test_prefix_hits_stay_consistent,
    tiny_gemma3,
)


@pytest.fixture(scope="module")
def hybrid_server(tiny_gemma3, serve_tmp):  # noqa: ANN001, ANN201, F811
    from nexus_vllm.eval.server import VllmServer

    server = VllmServer(tiny_gemma3, EVICT_ARGS, serve_tmp,
                        env={"NEXUS_VLLM_SELF_CHECK": "1"})
    yield server
    server.stop()
