"""Injected failures on a real server (~1 min on 2 CPU cores): scoring raises, a policy
raises, a plan is lost, a plan arrives twice. The server keeps serving, every block comes
back, each failure is counted in ``vllm:nexus_faults_total{kind}`` and logged once per
kind. (That nothing is freed which a worker may still read is shown step by step in
``test_protocol_faults.py``.)"""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from tests.integration.conftest import HAS_VLLM

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]

FAULTS = "score_error/5,policy_error/3,plan_lost/7,plan_duplicate/11"
# Worker-side and scheduler-side kinds each injection shows up as.
EXPECTED = {"score_error", "policy_error", "plan_lost", "plan_stale", "plan_unacknowledged"}
_WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima"]


def test_server_keeps_serving_through_injected_faults(tiny_model, serve_tmp) -> None:  # noqa: ANN001
    import openai

    from nexus_vllm.eval.server import VllmServer

    # The streaming setting: many events per request, so every fault kind gets its chance.
    server = VllmServer(tiny_model, ["--kv-eviction", "nexus", "--kv-budget", "256",
                                     "--kv-prompt-mode", "stream",
                                     "--kv-chunk-size", "128", "--block-size", "32",
                                     "--num-gpu-blocks-override", "200"],
                        serve_tmp, env={"NEXUS_VLLM_FAULTS": FAULTS})
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0,
                               timeout=300)

        def run(i: int) -> int:
            prompt = " ".join(_WORDS[(j * (i + 5)) % 12] for j in range(300 + 40 * i))
            r = client.completions.create(model=server.model, prompt=prompt, max_tokens=48,
                                          temperature=0.0, extra_body={"ignore_eos": True})
            return r.usage.completion_tokens

        with cf.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(run, range(8))) == [48] * 8
        metrics = server.metrics()
        counts = metrics.by_label("vllm:nexus_faults_total", "kind")
        log = server.log_path.read_text(errors="replace")
    finally:
        server.stop()
    assert set(counts) >= EXPECTED, counts
    assert metrics["vllm:nexus_evicted_blocks_total"] > 0  # events still happen
    assert metrics["vllm:nexus_free_blocks"] == metrics["vllm:nexus_total_blocks"]
    for kind in EXPECTED:
        lines = [ln for ln in log.splitlines() if f"({kind}; logged once per kind" in ln]
        assert len(lines) == 1, (kind, lines)
