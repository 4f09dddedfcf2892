"""End to end: eviction on a hybrid sliding-window model (a tiny random Gemma 3).

The checkpoint interleaves sliding-window layers (a 64-token window) with full-attention
ones, so vLLM's hybrid KV cache manager gives it a sliding group and a full-attention
group over one block pool. Eviction works on the full-attention group only; vLLM keeps
freeing the sliding group's blocks as they leave the window. One stock server (reference
greedy outputs) and one evicting server with the self-check on (each scored layer's key
view and the scores checked against the torch reference inside the server). Random
weights: plumbing, bounds and agreement with stock vLLM, never quality. ~3 min on 2 cores.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import pathlib
import subprocess
import sys

import pytest

from nexus_vllm.hf.testing import TINY_SLIDING_WINDOW
from tests.integration.conftest import HAS_VLLM
from tests.integration.test_e2e_serve import (
    BUDGET_TOKENS,
    CHUNK_TOKENS,
    _client,
    _greedy,
    _prompt,
    evict_alike,
    stock_greedy,
)

pytestmark = [
    pytest.mark.e2e, pytest.mark.slow,
    pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed"),
]

POOL_BLOCKS = 400
EVICT_ARGS = ["--kv-eviction", "nexus", "--kv-budget", str(BUDGET_TOKENS),
              "--kv-prompt-mode", "stream", "--kv-chunk-size", str(CHUNK_TOKENS),
              "--kv-eviction-seed", "7", "--num-gpu-blocks-override", str(POOL_BLOCKS)]
# Short (inside the window and the budget), past the window, and several budgets long.
PROMPTS = [_prompt(12, 1), _prompt(150, 2), _prompt(700, 3)]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):  # noqa: ANN001, ANN201
    from nexus_vllm.hf.testing import save_tiny_checkpoint

    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_gemma3"), family="gemma3"))


@pytest.fixture(scope="module")
def stock_outputs(tiny_gemma3, serve_tmp):  # noqa: ANN001, ANN201
    return stock_greedy(tiny_gemma3, PROMPTS, serve_tmp)


@pytest.fixture(scope="module")
def hybrid_server(tiny_gemma3, serve_tmp, stock_outputs):  # noqa: ANN001, ANN201
    # After stock_outputs: the two servers never share the 2 CPU cores.
    from nexus_vllm.eval.server import VllmServer

    server = VllmServer(tiny_gemma3, EVICT_ARGS, serve_tmp,
                        env={"NEXUS_VLLM_SELF_CHECK": "1"})
    yield server
    server.stop()


def test_tiny_model_is_hybrid(tiny_gemma3) -> None:  # noqa: ANN001
    """What the other tests rely on: sliding layers whose window the prompts outgrow."""
    cfg = json.loads((pathlib.Path(tiny_gemma3) / "config.json").read_text())
    assert cfg["sliding_window"] == TINY_SLIDING_WINDOW < 150
    assert {"sliding_attention", "full_attention"} == set(cfg["layer_types"])


def test_big_budget_and_short_prompts_equal_stock(hybrid_server, stock_outputs) -> None:  # noqa: ANN001
    """Nothing evicted (a budget of the whole context, or eviction off per request):
    the hybrid server gives stock vLLM's greedy tokens, past the window included."""
    for prompt, ref in zip(PROMPTS, stock_outputs):
        assert _greedy(hybrid_server, prompt, kv_budget=4096)[0] == ref
        assert _greedy(hybrid_server, prompt, kv_eviction="none")[0] == ref
    assert _greedy(hybrid_server, PROMPTS[0])[0] == stock_outputs[0]


def test_full_group_evicts_within_its_bound(hybrid_server) -> None:  # noqa: ANN001
    """Long prompts, four at a time: blocks are evicted from the full-attention group,
    no request ever holds more than budget + one chunk there nor more than its allowance
    in the sliding group (the self-check reads both after every step), and every block
    of every group comes back (vLLM's own usage returns to 0)."""
    before = hybrid_server.metrics()
    with cf.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(
            lambda i: _greedy(hybrid_server, _prompt(320, i), max_tokens=48), range(4)))
    for tokens, usage in outs:
        assert usage.prompt_tokens > 4 * BUDGET_TOKENS
        assert len(tokens) == usage.completion_tokens == 48
    after = hybrid_server.metrics()
    assert after["vllm:nexus_evicted_blocks_total"] > before.get(
        "vllm:nexus_evicted_blocks_total", 0.0)
    # Per request and step: live full-group blocks - (budget + one chunk), from vLLM's
    # own block lists (the peak gauge also counts the big-budget requests above).
    assert after["vllm:nexus_live_blocks_over_budget"] <= 0
    assert after["vllm:nexus_pool_over_bound"] <= 0
    log = hybrid_server.log_path.read_text(errors="replace")
    assert "in its sliding-window groups against an allowance" not in log
    assert after.get("vllm:nexus_faults_total", 0.0) == before.get("vllm:nexus_faults_total", 0.0)
    assert after["vllm:nexus_free_blocks"] == after["vllm:nexus_total_blocks"]
    assert after["vllm:kv_cache_usage_perc"] == 0.0


def test_prefix_hits_stay_consistent(hybrid_server) -> None:  # noqa: ANN001
    """The same evicting prompt twice (prefix caching is on by default): the second run
    may reuse only what the first published before it evicted, and gives the same
    tokens (a hit cut inside a sliding group's window would read null blocks)."""
    prompt = _prompt(500, 9)
    first, _ = _greedy(hybrid_server, prompt, max_tokens=32)
    second, _ = _greedy(hybrid_server, prompt, max_tokens=32)
    assert first == second


def test_bad_value_is_400_and_server_keeps_serving(hybrid_server) -> None:  # noqa: ANN001
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        _client(hybrid_server).completions.create(
            model=hybrid_server.model, prompt="hello", max_tokens=4,
            extra_body={"vllm_xargs": {"kv_budget": -5}})
    assert err.value.status_code == 400 and "vllm_xargs.kv_budget" in str(err.value)
    assert len(_greedy(hybrid_server, "hello again", max_tokens=4)[0]) == 4


@pytest.mark.parametrize("method", ["streaming", "random", "nexus", "h2o", "snapkv", "tova",
                                    "knorm", "expected"])
def test_server_and_transformers_paths_evict_alike(hybrid_server, tiny_gemma3,  # noqa: ANN001
                                                   method) -> None:
    """The same token-id prompt, several windows and budgets long, through the hybrid
    server and through the transformers path (only the full-attention layers evicted and
    scored, the sliding layers keep their window) evicts the same number of blocks and
    gives the same tokens (``test_e2e_serve.evict_alike``)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_gemma3)(_prompt(420, 13))["input_ids"]
    assert len(ids) > 2 * BUDGET_TOKENS > 4 * TINY_SLIDING_WINDOW  # the helper's prompt
    session = evict_alike(hybrid_server, tiny_gemma3, method)
    assert session.full_attention_layers == [1, 3]


def test_cancelled_streams_return_every_block(tiny_gemma3, hybrid_server,  # noqa: ANN001
                                              tmp_path) -> None:
    """A short soak on its own server with a small pool: cancelled streams, admission
    waits and preemption over both groups, no leaked block, no fault (last: it starts
    its server once the module's server is idle)."""
    from tests.integration.test_e2e_reliability import REPO

    out = tmp_path / "soak.json"
    args = [a for a in EVICT_ARGS if a not in ("--num-gpu-blocks-override", str(POOL_BLOCKS))]
    cmd = [sys.executable, str(REPO / "scripts" / "soak.py"), "--model",
           tiny_gemma3, "--requests", "16", "--concurrency", "8",
           "--prompt-tokens", "100,900", "--max-tokens", "16,32", "--cancel-fraction",
           "0.3", "--seed", "5", "--kv-cache-gib", "1",
           "--server-args=" + " ".join(args), "--output", str(out), "--log-dir",
           str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["completed"] + r["cancelled"] == r["requests"] == 16
    assert r["cancelled"] > 0 and r["errors"] == 0 and r["server_log_errors"] == 0
    assert r["leaked_blocks"] == 0 and r["free_blocks_end"] == r["total_blocks"]
    assert r["kv_cache_usage_perc_end"] == 0.0 and r["faults_total"] == 0, r["faults"]
    assert r["evicted_blocks"] > 0
