"""End to end: real ``vllm serve`` processes with the plugin, driven by the openai client.

One stock server (reference greedy outputs, then stopped) and one evicting server
(``--kv-eviction nexus --kv-budget 256 --kv-chunk-size 128``: 8 blocks of 32 tokens,
chunks of 4 blocks) are shared by the whole module. ~2.5 min on 2 CPU cores.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest

from nexus_vllm.core.budget import bound_blocks
from tests.integration.conftest import HAS_VLLM

pytestmark = [
    pytest.mark.e2e, pytest.mark.slow,
    pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed"),
]

BLOCK = 32
BUDGET_TOKENS = 256
CHUNK_TOKENS = 128
BUDGET_BLOCKS = BUDGET_TOKENS // BLOCK
CHUNK_BLOCKS = CHUNK_TOKENS // BLOCK
# A 160-block pool: one full 4096-token request fits, but 16 concurrent evicting requests
# (up to 12 blocks each) do not, so the streaming test also exercises preemption and
# recompute of evicting requests.
POOL_BLOCKS = 160
# The streaming setting (an event after every prompt chunk: budget + one chunk at most);
# requests ask for the other prompt modes per request.
EVICT_ARGS = ["--kv-eviction", "nexus", "--kv-budget", str(BUDGET_TOKENS),
              "--kv-prompt-mode", "stream",
              "--kv-chunk-size", str(CHUNK_TOKENS), "--kv-eviction-seed", "7",
              "--num-gpu-blocks-override", str(POOL_BLOCKS)]
_WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
          "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
          "sierra", "tango", "uniform", "victor", "whiskey"]


def _prompt(n_words: int, offset: int = 0) -> str:
    return " ".join(_WORDS[(i * 7 + offset) % len(_WORDS)] for i in range(n_words))


# Short prompts (no eviction possible) and long ones (several chunks).
PROMPTS = [_prompt(20, 1), _prompt(150, 2), _prompt(700, 3)]


def _client(server):  # noqa: ANN001, ANN202
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _greedy(server, prompt: str, max_tokens: int = 24, **extra):  # noqa: ANN001, ANN003, ANN202
    body = {"vllm_xargs": extra} if extra else None
    r = _client(server).completions.create(
        model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
        logprobs=1, extra_body=body,
    )
    choice = r.choices[0]
    return choice.logprobs.tokens, r.usage


def stock_greedy(model: str, prompts: list[str], serve_tmp):  # noqa: ANN001, ANN201
    """Stock vLLM's greedy tokens for each prompt: one server without the plugin's flags,
    stopped before the caller starts its own (the 2 CPU cores are never shared)."""
    from nexus_vllm.eval.server import VllmServer

    server = VllmServer(model, ["--block-size", str(BLOCK)], serve_tmp)
    try:
        return [_greedy(server, p)[0] for p in prompts]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stock_outputs(tiny_model, serve_tmp):  # noqa: ANN001, ANN201
    return stock_greedy(tiny_model, PROMPTS, serve_tmp)


@pytest.fixture(scope="module")
def evict_server(tiny_model, serve_tmp, stock_outputs):  # noqa: ANN001, ANN201
    # Depends on stock_outputs so the two servers never share the 2 CPU cores.
    from nexus_vllm.eval.server import VllmServer

    # The self-check verifies, inside the running server, that each layer's key view holds
    # the keys vLLM wrote and that scoring matches the torch reference.
    server = VllmServer(tiny_model, EVICT_ARGS, serve_tmp, env={"NEXUS_VLLM_SELF_CHECK": "1"})
    print(f"evicting server ready in {server.startup_seconds:.1f}s")
    yield server
    server.stop()


def test_big_budget_equals_stock_greedy(evict_server, stock_outputs) -> None:  # noqa: ANN001
    for prompt, ref in zip(PROMPTS, stock_outputs):
        tokens, _ = _greedy(evict_server, prompt, kv_budget=4096)  # = --max-model-len: never evicts
        assert tokens == ref
        tokens, _ = _greedy(evict_server, prompt, kv_eviction="none")
        assert tokens == ref


def test_short_prompt_untouched_by_eviction(evict_server, stock_outputs) -> None:  # noqa: ANN001
    # 20 words + 24 new tokens stay far below the 256-token budget: nothing is evicted,
    # so the server's default config must reproduce stock vLLM exactly.
    tokens, _ = _greedy(evict_server, PROMPTS[0])
    assert tokens == stock_outputs[0]


def test_budget_holds_and_blocks_return(evict_server) -> None:  # noqa: ANN001
    before = evict_server.metrics()
    usage_seen: list[float] = []
    live_seen: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                m = evict_server.metrics()
            except OSError:
                return
            usage_seen.append(m.get("vllm:kv_cache_usage_perc", 0.0))
            live_seen.append(m.get("vllm:nexus_live_blocks_max", 0.0))
            time.sleep(0.05)

    n_req = 4
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        with cf.ThreadPoolExecutor(n_req) as pool:
            outs = list(pool.map(
                lambda i: _greedy(evict_server, _prompt(320, i), max_tokens=64), range(n_req)))
    finally:
        stop.set()
        poller.join()
    for tokens, usage in outs:
        assert usage.prompt_tokens > 4 * BUDGET_TOKENS
        assert len(tokens) == usage.completion_tokens > 0

    after = evict_server.metrics()
    bound = BUDGET_BLOCKS + CHUNK_BLOCKS
    # Scheduler-side high-water mark of (live blocks - own budget - one chunk) over every
    # request since start, taken from vLLM's own block lists at each step.
    assert after["vllm:nexus_live_blocks_over_budget"] <= 0
    assert max(live_seen) <= bound
    # vLLM's own pool usage never exceeded n_req * (budget + chunk) blocks; without
    # eviction the prompts alone would need n_req * ~ (4 * budget) blocks.
    total = after["vllm:nexus_total_blocks"]
    assert max(usage_seen) * total <= n_req * bound + 0.5
    # Evictions really happened and were counted.
    assert after["vllm:nexus_evicted_blocks_total"] > before.get(
        "vllm:nexus_evicted_blocks_total", 0.0)
    assert after["vllm:nexus_eviction_events_total"] > before.get(
        "vllm:nexus_eviction_events_total", 0.0)
    assert after["vllm:nexus_scoring_seconds_total"] > 0.0
    # Every block came back: the pool is full again and vLLM reports zero usage.
    assert after["vllm:nexus_free_blocks"] == after["vllm:nexus_total_blocks"]
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert after["vllm:nexus_live_blocks"] == 0.0


def test_sixteen_concurrent_streams_complete(evict_server) -> None:  # noqa: ANN001
    client = _client(evict_server)

    def stream(i: int) -> tuple[str | None, int]:
        s = client.chat.completions.create(
            model=evict_server.model, stream=True, max_tokens=40, temperature=0.8, seed=i,
            messages=[{"role": "user", "content": _prompt(100 + 10 * i, i)}],
        )
        n, reason = 0, None
        for chunk in s:
            if chunk.choices:
                if chunk.choices[0].delta.content:
                    n += 1
                reason = chunk.choices[0].finish_reason or reason
        return reason, n

    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(stream, range(16)))
    assert all(reason in ("stop", "length") for reason, _ in results), results
    assert sum(n for _, n in results) > 0
    m = evict_server.metrics()
    print(f"preemptions so far: {m.get('vllm:num_preemptions_total')}, evicted blocks: "
          f"{m['vllm:nexus_evicted_blocks_total']}")
    assert m["vllm:nexus_total_blocks"] == POOL_BLOCKS - 1
    assert m["vllm:nexus_free_blocks"] == m["vllm:nexus_total_blocks"]
    assert m["vllm:nexus_live_blocks_over_budget"] <= 0


@pytest.mark.parametrize("xargs, field", [
    ({"kv_budget": -5}, "kv_budget"),
    ({"kv_budget": "lots"}, "kv_budget"),
    ({"kv_budget": 10}, "kv_budget"),  # below the forced sink + recent blocks
    ({"kv_eviction": "bogus"}, "kv_eviction"),
])
def test_bad_request_values_are_400(evict_server, xargs, field) -> None:  # noqa: ANN001
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        _client(evict_server).completions.create(
            model=evict_server.model, prompt="hello", max_tokens=4,
            extra_body={"vllm_xargs": xargs},
        )
    assert err.value.status_code == 400
    assert f"vllm_xargs.{field}" in str(err.value)
    # The server keeps serving.
    tokens, _ = _greedy(evict_server, "hello again", max_tokens=4)
    assert len(tokens) == 4


def test_per_request_budget_and_method(evict_server) -> None:  # noqa: ANN001
    before = evict_server.metrics()["vllm:nexus_evicted_blocks_total"]
    tokens, usage = _greedy(evict_server, _prompt(700, 5), max_tokens=8,
                            kv_budget=512, kv_eviction="h2o")
    assert len(tokens) == usage.completion_tokens == 8
    assert evict_server.metrics()["vllm:nexus_evicted_blocks_total"] > before


def test_evicting_request_unaffected_by_block_reuse(evict_server) -> None:  # noqa: ANN001
    """A greedy evicting request gives the same tokens alone and while other requests
    allocate the blocks it freed: attention never reads an evicted (reused) block."""
    target = _prompt(400, 11)
    alone, _ = _greedy(evict_server, target, max_tokens=40)
    with cf.ThreadPoolExecutor(6) as pool:
        others = [pool.submit(_greedy, evict_server, _prompt(300, 20 + i), 40)
                  for i in range(5)]
        busy, _ = _greedy(evict_server, target, max_tokens=40)
        for f in others:
            f.result()
    assert busy == alone


@pytest.mark.parametrize("method", ["streaming", "random", "nexus", "h2o", "snapkv", "tova",
                                    "knorm", "expected"])
def test_server_and_transformers_paths_evict_alike(evict_server, tiny_model,
                                                   method) -> None:  # noqa: ANN001
    """The same token-id prompt through the server and through the transformers path
    (``nexus_vllm.hf.generate_ids``, chunked and triggered like the plugin, seeded like a
    request without a seed) evicts the same number of blocks and gives the same tokens:
    both run in float32 on the CPU, and the scores agree to rounding."""
    evict_alike(evict_server, tiny_model, method)


def evict_alike(server, model_path: str, method: str):  # noqa: ANN001, ANN201
    """Send a 420-word token-id prompt with ``method`` to ``server`` (started with
    ``EVICT_ARGS``' budget, chunk, block and seed, in ``stream``) and run it through the
    transformers path with the same config; assert equal evicted blocks (> 0, decode events
    included) and equal tokens. Returns the transformers session."""
    import requests
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nexus_vllm.core import EvictionConfig
    from nexus_vllm.hf import generate_ids

    tok = AutoTokenizer.from_pretrained(model_path)
    ids = tok(_prompt(420, 13))["input_ids"]
    before = server.metrics().get("vllm:nexus_evicted_blocks_total", 0.0)
    # ignore_eos: 40 tokens by construction, as the transformers path generates (a
    # random-weight model may sample its EOS).
    body = {"model": server.model, "prompt": ids, "max_tokens": 40, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True,
            "vllm_xargs": {"kv_eviction": method}}
    r = requests.post(server.base_url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    served = r.json()["choices"][0]["token_ids"]
    evicted = server.metrics()["vllm:nexus_evicted_blocks_total"] - before

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    cfg = EvictionConfig(method=method, max_tokens=BUDGET_TOKENS, chunk_size=CHUNK_TOKENS,
                         seed=7, block_size=BLOCK, prompt_mode="stream")  # the server's
    hf_ids, session = generate_ids(model, ids, cfg, max_new_tokens=40)
    hf_evicted = sum(e.blocks_before - e.blocks_after for e in session.events)
    assert any(not e.prefill for e in session.events)  # decode events too
    assert evicted == hf_evicted > 0
    assert served == hf_ids
    return session


# -- prompt_mode, per request on the streaming server --------------------------------------
_PEAK = "vllm:nexus_request_peak_live_blocks"


def _peaks(server) -> dict[str, tuple[float, float]]:  # noqa: ANN001
    """``prompt_mode -> (sum, count)`` of the per-request peak histogram."""
    m = server.metrics()
    sums, counts = (m.by_label(f"{_PEAK}_{part}", "prompt_mode") for part in ("sum", "count"))
    return {mode: (sums.get(mode, 0.0), count) for mode, count in counts.items()}


def _wait_peaks(server, before, want: dict[str, int]):  # noqa: ANN001, ANN202
    """The histogram once ``want[mode]`` more requests of each mode were counted (a
    request's peak is exported with the stats of the step it finishes in)."""
    deadline = time.monotonic() + 30
    while True:
        now = _peaks(server)
        done = all(now.get(m, (0, 0))[1] - before.get(m, (0, 0))[1] >= n
                   for m, n in want.items())
        if done or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def _mode_config(xargs: dict):  # noqa: ANN202
    from nexus_vllm.core import EvictionConfig

    return EvictionConfig(method="nexus", max_tokens=xargs.get("kv_budget", BUDGET_TOKENS),
                          chunk_size=CHUNK_TOKENS, seed=7, block_size=BLOCK,
                          prompt_mode=xargs["kv_prompt_mode"],
                          prefill_budget=xargs.get("kv_prefill_budget"))


# (vllm_xargs, max_tokens): keep mode's budget counts generated tokens, so it decodes past
# a (smaller) budget to evict at all.
MODE_CASES = {
    "end": ({"kv_prompt_mode": "end"}, 40),
    "end-prefill-budget": ({"kv_prompt_mode": "end", "kv_prefill_budget": 384}, 40),
    "keep": ({"kv_prompt_mode": "keep", "kv_budget": 192}, 260),
}


@pytest.fixture(scope="module")
def hf_tiny(tiny_model):  # noqa: ANN001, ANN201
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(tiny_model),
            AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval())


@pytest.mark.parametrize("case", list(MODE_CASES))
def test_prompt_modes_server_and_transformers_evict_alike(evict_server, hf_tiny,
                                                          case) -> None:  # noqa: ANN001
    """Per-request ``kv_prompt_mode`` on the streaming server against the transformers
    path under the same config: the same greedy tokens, the same evicted-block count and
    the same peak live blocks (``vllm:nexus_request_peak_live_blocks``), within the
    config's bound. The prompt's last chunk is 10 tokens, so the prompt-end event's
    32-row window spans two chunks on both paths."""
    import requests

    from nexus_vllm.core import cdiv
    from nexus_vllm.hf import generate_ids

    xargs, max_new = MODE_CASES[case]
    tok, model = hf_tiny
    ids = tok(_prompt(420, 13))["input_ids"][: 4 * CHUNK_TOKENS + 10]
    assert len(ids) == 4 * CHUNK_TOKENS + 10 > BUDGET_TOKENS + CHUNK_TOKENS
    mode = xargs["kv_prompt_mode"]
    before = evict_server.metrics().get("vllm:nexus_evicted_blocks_total", 0.0)
    peaks0 = _peaks(evict_server)
    body = {"model": evict_server.model, "prompt": ids, "max_tokens": max_new,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "vllm_xargs": {"kv_eviction": "nexus", **xargs}}
    r = requests.post(evict_server.base_url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    served = r.json()["choices"][0]["token_ids"]
    peaks1 = _wait_peaks(evict_server, peaks0, {mode: 1})
    after = evict_server.metrics()
    evicted = after["vllm:nexus_evicted_blocks_total"] - before

    cfg = _mode_config(xargs)
    hf_ids, session = generate_ids(model, ids, cfg, max_new_tokens=max_new)
    hf_evicted = sum(e.blocks_before - e.blocks_after for e in session.events)
    assert served == hf_ids
    assert evicted == hf_evicted > 0
    prefill = [e.seen for e in session.events if e.prefill]
    if case == "end":
        assert prefill == [len(ids)]  # the one prompt-end event
    elif case == "keep":
        assert prefill == [] and all(
            set(range(len(ids))) <= set(e.kept_positions.tolist()) for e in session.events)
    else:
        assert len(prefill) > 1 and prefill[-1] == len(ids)
    # The request's peak: as the transformers cache's, and within the admission bound.
    peak_sum = peaks1[mode][0] - peaks0.get(mode, (0.0, 0.0))[0]
    assert peaks1[mode][1] - peaks0.get(mode, (0.0, 0.0))[1] == 1
    hf_peak = max([e.blocks_before for e in session.events]
                  + [cdiv(session.cache_len, BLOCK)])
    assert peak_sum == hf_peak <= bound_blocks(cfg, len(ids), len(ids) + max_new)
    assert after["vllm:nexus_live_blocks_over_budget"] <= 0


def test_prompt_modes_concurrently_hold_their_bounds(evict_server) -> None:  # noqa: ANN001
    """Requests of every prompt mode at once (two of each): each one's peak live blocks
    stay within its config's bound, no request passes its hard limit, and every block
    comes back."""
    n_words = 200  # ~650 tokens, above budget + one chunk
    cases = [{}, {"kv_prompt_mode": "end"},
             {"kv_prompt_mode": "end", "kv_prefill_budget": 384},
             {"kv_prompt_mode": "keep", "kv_budget": 192}] * 2
    peaks0 = _peaks(evict_server)
    with cf.ThreadPoolExecutor(len(cases)) as pool:
        outs = list(pool.map(lambda ix: _greedy(evict_server, _prompt(n_words, 30 + ix[0]),
                                                max_tokens=48, **ix[1]), enumerate(cases)))
    want: dict[str, int] = {}
    for xargs in cases:
        mode = xargs.get("kv_prompt_mode", "stream")
        want[mode] = want.get(mode, 0) + 1
    peaks1 = _wait_peaks(evict_server, peaks0, want)
    for mode, n in want.items():
        got = peaks1[mode][1] - peaks0.get(mode, (0, 0))[1]
        assert got == n, (mode, got)
    # The histogram holds sums: the mode's peaks are within the sum of its bounds.
    for mode in want:
        bound = sum(bound_blocks(
            _mode_config({"kv_prompt_mode": "stream", **x}),
            u.prompt_tokens, u.prompt_tokens + u.completion_tokens)
            for x, (_, u) in zip(cases, outs) if x.get("kv_prompt_mode", "stream") == mode)
        assert peaks1[mode][0] - peaks0.get(mode, (0, 0))[0] <= bound, mode
    m = evict_server.metrics()
    assert m["vllm:nexus_live_blocks_over_budget"] <= 0
    assert m["vllm:nexus_free_blocks"] == m["vllm:nexus_total_blocks"]
    assert m["vllm:nexus_live_blocks"] == 0.0
