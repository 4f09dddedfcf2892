"""One realistic case: the embedded SmolLM2-135M-Instruct served with Nexus eviction at
a 256-token budget on a ~600-token chat (~55 s on 2 CPU cores)."""

from __future__ import annotations

import pytest

from tests.integration.conftest import HAS_VLLM

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]

BUDGET, CHUNK = 256, 128
FACT = "My secret number is 4721. "
FILLER = "The city of Veltra sits on a river. Its bakers rise at four. " * 30
QUESTION = " What is my secret number? Answer with the number only."


@pytest.fixture(scope="module")
def smol_server(serve_tmp):  # noqa: ANN001, ANN201
    try:
        from nexus_vllm.models import default_model_path

        model = str(default_model_path())
    except Exception as exc:  # the GGUF package or converter is missing
        pytest.skip(f"embedded model unavailable: {exc}")
    from nexus_vllm.eval.server import VllmServer

    server = VllmServer(model, ["--kv-eviction", "nexus", "--kv-budget", str(BUDGET),
                                "--kv-chunk-size", str(CHUNK)], serve_tmp)
    yield server
    server.stop()


def test_smollm2_long_chat_under_budget(smol_server) -> None:  # noqa: ANN001
    import openai

    client = openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused",
                           max_retries=0, timeout=300)
    before = smol_server.metrics()
    r = client.chat.completions.create(
        model=smol_server.model, max_tokens=24, temperature=0.0,
        messages=[{"role": "user", "content": FACT + FILLER + QUESTION}],
    )
    text = r.choices[0].message.content or ""
    assert r.usage is not None
    print(f"SmolLM2 @ {BUDGET}/{r.usage.prompt_tokens} tokens: {text!r}")
    assert r.usage.prompt_tokens > 2 * BUDGET
    assert text.strip() and r.choices[0].finish_reason in ("stop", "length")
    after = smol_server.metrics()
    assert after["vllm:nexus_evicted_blocks_total"] > before.get(
        "vllm:nexus_evicted_blocks_total", 0.0)
    assert after["vllm:nexus_live_blocks_over_budget"] <= 0
    assert after["vllm:nexus_free_blocks"] == after["vllm:nexus_total_blocks"]


def test_quality_tool_dense_matches_hf_path(smol_server, capsys) -> None:  # noqa: ANN001
    """The suite's prompts through the server reproduce the transformers path exactly with
    eviction off, so server-vs-HF comparisons at a budget compare eviction only."""
    import json

    from nexus_vllm.integration.quality import main

    assert main(["--base-url", smol_server.base_url, "--samples", "2", "--context", "512",
                 "--method", "none", "--budget", str(BUDGET), "--hf"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]
    samples = [r for r in rows if "index" in r]
    assert len(samples) == 2
    assert all(r["server_text"] == r["hf_text"] for r in samples), samples
    assert rows[-1]["summary"]["diff"] == 0.0
