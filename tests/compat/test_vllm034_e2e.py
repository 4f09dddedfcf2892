"""vLLM 0.34 end to end, on the CPU build made by ``scripts/setup_vllm034.sh``.

0.34 removed Model Runner V1; on a CPU box without triton-cpu it serves with its
standalone CPU runner (``CPUBlockTables``), so these tests run the eviction path through
the V2-family adapter (``integration/compat/runners.py: HostTables``) with 0.34's scheduler,
KV-cache manager, config and API server. They are a subset of the main end-to-end suite,
imported from it and run here unchanged (the fixtures start servers with this
interpreter), plus what only 0.34 can show. ``bash scripts/test_vllm034.sh --ci`` (what
``scripts/test.sh`` runs) runs this module; ``test_vllm034_full.py`` adds the cancelled
streams, stock equality and an unsupported version (``bash scripts/test_vllm034.sh``).
Under any other vLLM they skip.

What the build does not prove: the GPU V2 runner (``StagedTables``: unit-tested in
``tests/integration/test_runners.py``, not yet run on a GPU), and stock 0.34 on CPU
(the Triton runner where triton-cpu exists). Seven bookkeeping ops of the build are
pure-torch stand-ins (``scripts/vllm034_cpu/``).
"""

from __future__ import annotations

import pytest

from tests.compat._marks import VLLM034

pytestmark = VLLM034

# The core of the main suite's end-to-end checks, run unchanged on 0.34 (same assertions;
# the evicting server is this module's, without the stock reference server).
from tests.integration.test_e2e_serve import (  # noqa: E402, F401
    EVICT_ARGS,
    test_bad_request_values_are_400,
    test_budget_holds_and_blocks_return,
    test_server_and_transformers_paths_evict_alike,
)


@pytest.fixture(scope="module")
def evict_server(tiny_model, serve_tmp):  # noqa: ANN001, ANN201
    from nexus_vllm.eval.server import VllmServer

    server = VllmServer(tiny_model, EVICT_ARGS, serve_tmp, env={"NEXUS_VLLM_SELF_CHECK": "1"})
    yield server
    server.stop()


def test_evicting_server_runs_the_v2_cpu_runner(evict_server) -> None:  # noqa: ANN001
    """The server evicts on the runner vLLM picked, through the V2-family adapter."""
    log = evict_server.log_tail(100000)
    assert "nexus-vllm worker: v2-cpu model runner (StandaloneCPUModelRunner)" in log
    assert "VLLM_USE_V2_MODEL_RUNNER" not in log
