"""vLLM 0.34 end to end, the rest of the subset (``bash scripts/test_vllm034.sh``).

``test_vllm034_e2e.py`` has the core (budget, 400s, parity, the runner); this module adds
greedy equality with a stock 0.34 server, every block back after 200 cancelled streams,
and the plugin installed next to a vLLM it does not support. About 4 minutes more.
"""

from __future__ import annotations

from tests.compat._marks import VLLM034

pytestmark = VLLM034

from tests.integration.test_e2e_reliability import (  # noqa: E402, F401
    server,
    test_cancelled_streams_return_every_block,
)
from tests.integration.test_e2e_serve import (  # noqa: E402, F401
    evict_server,
    stock_outputs,
    test_big_budget_equals_stock_greedy,
)


def test_unsupported_vllm_leaves_stock_serving_alone(tiny_model, serve_tmp) -> None:  # noqa: ANN001, E501
    """The plugin installed next to a vLLM it does not support (this build, with its
    dist-info claiming 0.35.0): stock serving answers, and ``--kv-eviction`` fails at
    startup with a message naming the supported range."""
    import pathlib
    import subprocess

    import requests

    from nexus_vllm.eval.server import CPU_FLAGS, VllmServer, server_env, vllm_cmd
    from nexus_vllm.integration.compat.versions import SUPPORTED_VLLM

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
