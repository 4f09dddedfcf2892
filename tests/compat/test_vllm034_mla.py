"""vLLM 0.34 end to end on multi-head latent attention (the tiny random DeepSeek-V2 of
``tests/integration/test_e2e_mla.py``): 0.34's CPU MLA backend under its standalone CPU
runner, chunked prefill off as on 0.32. The main suite's MLA checks, imported and run
unchanged (``bash scripts/test_vllm034.sh``)."""

from __future__ import annotations

from tests.compat._marks import VLLM034

pytestmark = VLLM034

from tests.integration.test_e2e_mla import (  # noqa: E402, F401
    mla_server,
    test_bad_request_values_are_400,
    test_budget_holds_and_blocks_return,
    test_cancelled_streams_return_every_block,
    tiny_mla,
)


def test_mla_server_runs_the_v2_cpu_runner(mla_server) -> None:  # noqa: ANN001, F811
    log = mla_server.log_tail(100000)
    assert "nexus-vllm worker: v2-cpu model runner (StandaloneCPUModelRunner)" in log
    assert "Using CPU_MLA backend" in log
