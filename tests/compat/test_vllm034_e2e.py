"""vLLM 0.34 end to end, on the CPU build made by ``scripts/setup_vllm034.sh``.

0.34 removed Model Runner V1; on a CPU box without triton-cpu it serves with its
standalone CPU runner (``CPUBlockTables``), so these tests run the eviction path through
the V2-family adapter (``integration/runners.py: HostTables``) with 0.34's scheduler,
KV-cache manager, config and API server. They are a subset of the main end-to-end suite,
imported from it and run here unchanged (the fixtures start servers with this
interpreter), plus what only 0.34 can show. Run them with ``bash scripts/test_vllm034.sh``;
under any other vLLM they skip.

What the build does not prove: the GPU V2 runner (``StagedTables``: unit-tested in
``tests/integration/test_runners.py``, not yet run on a GPU), and stock 0.34 on CPU
(the Triton runner where triton-cpu exists). Seven bookkeeping ops of the build are
pure-torch stand-ins (``scripts/vllm034_cpu/``).
"""

from __future__ import annotations

import importlib.metadata

import pytest

from tests.integration.conftest import HAS_VLLM


def _is_034() -> bool:
    if not HAS_VLLM:
        return False
    return importlib.metadata.version("vllm").startswith("0.34.")


pytestmark = [
    pytest.mark.e2e, pytest.mark.slow, pytest.mark.compat,
    pytest.mark.skipif(not _is_034(), reason="needs the vLLM 0.34 build "
                       "(bash scripts/test_vllm034.sh)"),
]

# The subset of the main suite, run unchanged on 0.34 (same fixtures, same assertions).
from tests.integration.test_e2e_reliability import (  # noqa: E402, F401
    server,
    test_cancelled_streams_return_every_block,
)
from tests.integration.test_e2e_serve import (  # noqa: E402, F401
    evict_server,
    stock_outputs,
    test_bad_request_values_are_400,
    test_big_budget_equals_stock_greedy,
    test_budget_holds_and_blocks_return,
    test_server_and_transformers_paths_evict_alike,
)


def test_evicting_server_runs_the_v2_cpu_runner(evict_server) -> None:  # noqa: ANN001, F811
    """The server evicts on the runner vLLM picked, through the V2-family adapter."""
    log = evict_server.log_tail(100000)
    assert "nexus-vllm worker: v2-cpu model runner (StandaloneCPUModelRunner)" in log
    assert "VLLM_USE_V2_MODEL_RUNNER" not in log


def test_unsupported_vllm_leaves_stock_serving_alone(tiny_model, serve_tmp) -> None:  # noqa: ANN001, E501
    """The plugin installed next to a vLLM it does not support (this build, with its
    dist-info claiming 0.35.0): stock serving answers, and ``--kv-eviction`` fails at
    startup with a message naming the supported range."""
    import pathlib
    import subprocess

    import requests

    from nexus_vllm.eval.server import CPU_FLAGS, VllmServer, server_env, vllm_cmd
    from nexus_vllm.integration.versions import SUPPORTED_VLLM

    repo = pathlib.Path(__file__).resolve().parents[2]
    fake = serve_tmp / "venv-vllm035"
    subprocess.run(["bash", str(repo / "scripts/setup_vllm034.sh"), "--dest", str(fake),
                    "--version-as", "0.35.0+cpu"], check=True, timeout=900)
    python = str(fake / "bin" / "python")

    refused = subprocess.run(
        vllm_cmd(tiny_model, *CPU_FLAGS, "--kv-eviction", "nexus", "--kv-budget", "256",
                 python=python),
        env=server_env(serve_tmp), capture_output=True, text=True, timeout=600)
    text = refused.stdout + refused.stderr
    assert refused.returncode != 0, text[-3000:]
    assert f"nexus-vllm supports vLLM {SUPPORTED_VLLM}; this is vLLM 0.35.0+cpu" in text
    assert "unrecognized arguments: --kv-eviction" in text

    stock = VllmServer(tiny_model, [], serve_tmp, python=python)
    try:
        r = requests.post(stock.base_url + "/v1/completions", timeout=300, json={
            "model": stock.model, "prompt": "hello there", "max_tokens": 8,
            "temperature": 0.0})
        r.raise_for_status()
        assert r.json()["usage"]["completion_tokens"] == 8
        assert "no patch applied" in stock.log_tail(100000)
    finally:
        stock.stop()
