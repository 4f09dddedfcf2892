"""End to end: eviction on a model with learned attention sinks (a tiny random gpt-oss).

gpt-oss adds one learned logit per query head to every row's softmax (vLLM's CPU
attention takes it as ``s_aux``), makes every even layer sliding (a 64-token window here)
and routes a mixture of experts (unquantized). vLLM's hybrid KV cache manager gives it a
sliding group and a full-attention group; eviction works on the full-attention group
only, scored without the sink (each block's share of the row's mass over the cached
keys), the same on the transformers path. One stock server (reference greedy outputs)
and one evicting server with the self-check on. Random weights: plumbing, bounds and
agreement with stock vLLM and with transformers, never quality. ~2 min on 2 cores.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import pathlib

import pytest

from nexus_vllm.hf.testing import TINY_SLIDING_WINDOW
from tests.integration.conftest import HAS_VLLM
from tests.integration.test_e2e_serve import (
    BLOCK,
    BUDGET_TOKENS,
    CHUNK_TOKENS,
    _greedy,
    _prompt,
    evict_alike,
    stock_greedy,
)

pytestmark = [
    pytest.mark.e2e, pytest.mark.slow, pytest.mark.long,
    pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed"),
]

POOL_BLOCKS = 400
EVICT_ARGS = ["--kv-eviction", "nexus", "--kv-budget", str(BUDGET_TOKENS),
              "--kv-prompt-mode", "stream", "--kv-chunk-size", str(CHUNK_TOKENS),
              "--kv-eviction-seed", "7", "--block-size", str(BLOCK),
              "--num-gpu-blocks-override", str(POOL_BLOCKS)]
# Inside the window; past the window but inside the budget (with its 24 new tokens);
# several budgets long.
PROMPTS = [_prompt(12, 1), _prompt(40, 2), _prompt(700, 3)]


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):  # noqa: ANN001, ANN201
    from nexus_vllm.hf.testing import save_tiny_checkpoint

    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_gpt_oss"), family="gpt_oss",
                                    heads=4, kv_heads=2, head_dim=32))


@pytest.fixture(scope="module")
def stock_outputs(tiny_gpt_oss, serve_tmp):  # noqa: ANN001, ANN201
    return stock_greedy(tiny_gpt_oss, PROMPTS, serve_tmp)


@pytest.fixture(scope="module")
def sinks_server(tiny_gpt_oss, serve_tmp, stock_outputs):  # noqa: ANN001, ANN201
    # After stock_outputs: the two servers never share the 2 CPU cores.
    from nexus_vllm.eval.server import VllmServer

    server = VllmServer(tiny_gpt_oss, EVICT_ARGS, serve_tmp,
                        env={"NEXUS_VLLM_SELF_CHECK": "1"})
    yield server
    server.stop()


def test_tiny_model_has_sinks_and_windows(tiny_gpt_oss) -> None:  # noqa: ANN001
    """What the other tests rely on: a gpt-oss checkpoint with sinks, unquantized, whose
    sliding window the prompts outgrow."""
    from safetensors import safe_open

    root = pathlib.Path(tiny_gpt_oss)
    cfg = json.loads((root / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss" and "quantization_config" not in cfg
    assert cfg["sliding_window"] == TINY_SLIDING_WINDOW < 150
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    with safe_open(str(root / "model.safetensors"), "pt") as f:
        sinks = f.get_tensor("model.layers.1.self_attn.sinks")
    assert sinks.shape == (4,) and sinks.abs().max() > 0.5


def test_unbound_budget_equals_stock(sinks_server, stock_outputs) -> None:  # noqa: ANN001
    """Nothing evicted (a budget of the whole context, or a prompt inside the budget):
    the evicting server gives stock vLLM's greedy tokens, past the window included."""
    for prompt, ref in zip(PROMPTS, stock_outputs):
        assert _greedy(sinks_server, prompt, kv_budget=4096)[0] == ref
    for prompt, ref in zip(PROMPTS[:2], stock_outputs[:2]):
        assert _greedy(sinks_server, prompt)[0] == ref


def test_long_prompts_evict_within_their_bound(sinks_server) -> None:  # noqa: ANN001
    """Long prompts, two at a time: blocks are evicted from the full-attention group,
    no request holds more than budget + one chunk there (the self-check also reads the
    sliding groups' allowance after every step), and every block comes back."""
    before = sinks_server.metrics()
    with cf.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(
            lambda i: _greedy(sinks_server, _prompt(320, i), max_tokens=32), range(2)))
    for tokens, usage in outs:
        assert usage.prompt_tokens > 4 * BUDGET_TOKENS
        assert len(tokens) == usage.completion_tokens == 32
    after = sinks_server.metrics()
    assert after["vllm:nexus_evicted_blocks_total"] > before.get(
        "vllm:nexus_evicted_blocks_total", 0.0)
    assert after["vllm:nexus_live_blocks_over_budget"] <= 0
    assert after["vllm:nexus_pool_over_bound"] <= 0
    log = sinks_server.log_path.read_text(errors="replace")
    assert "in its sliding-window groups against an allowance" not in log
    assert after.get("vllm:nexus_faults_total", 0.0) == before.get("vllm:nexus_faults_total", 0.0)
    assert after["vllm:nexus_free_blocks"] == after["vllm:nexus_total_blocks"]
    assert after["vllm:kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("method", ["nexus", "snapkv", "expected"])
def test_server_and_transformers_paths_evict_alike(sinks_server, tiny_gpt_oss,  # noqa: ANN001
                                                   method) -> None:
    """The same token-id prompt through the evicting server and through the transformers
    path (its own eager attention, sinks included; only the full-attention layers
    evicted and scored, without the sink) evicts the same number of blocks and gives the
    same tokens (``test_e2e_serve.evict_alike``; ``expected`` un-rotates with gpt-oss's
    YaRN rotary)."""
    session = evict_alike(sinks_server, tiny_gpt_oss, method)
    assert session.full_attention_layers == [1, 3]
