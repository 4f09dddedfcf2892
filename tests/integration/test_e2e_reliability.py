"""Reliability end to end: cancelled streams, preemption and a short soak.

Tiny random Llama (plumbing only). The module shares one evicting server
(``--kv-budget 256 --kv-chunk-size 128``, a 96-block pool: 95 usable, block 0 is vLLM's
null block) whose pool is small enough that a few long non-evicting requests beside
evicting ones force vLLM to preempt. vLLM records preemptions per request only as a histogram, so the server
loads a probe (a ``sitecustomize`` on its PYTHONPATH, written below) that logs each one:
the request's seed and how many tokens it had generated when it was preempted.

A preempted request replays exactly only if it was preempted before its first token.
vLLM recomputes the tokens a request had already generated inside a prefill chunk, while
the first run computed them one decode step at a time with eviction events in between,
and the plugin's decode event clock restarts after that chunk. So a request preempted
after generating G tokens is held to its first G tokens (docs/reliability.md has the
trace and the two causes).

``test_short_soak`` runs first: it starts its own server (``scripts/soak.py``), and the
module's server is created only after it, so two servers never share the 2 CPU cores.
About 2 minutes on 2 idle CPU cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import random
import re
import subprocess
import sys
import time

import pytest

from tests.integration.conftest import HAS_VLLM

pytestmark = [
    pytest.mark.e2e, pytest.mark.slow,
    pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed"),
]

REPO = pathlib.Path(__file__).resolve().parents[2]
BLOCK = 32
POOL_BLOCKS = 96
SERVER_ARGS = ["--kv-eviction", "nexus", "--kv-budget", "256", "--kv-chunk-size", "128",
               "--kv-eviction-seed", "7", "--num-gpu-blocks-override", str(POOL_BLOCKS),
               # The pool holds 95 * 32 = 3040 tokens; vLLM refuses a max_model_len that
               # one request could not fit.
               "--max-model-len", "2048", "--max-num-seqs", "32"]
METHODS = ("nexus", "h2o", "snapkv", "streaming", "none")
BUDGETS = (192, 256, 384, 512)
VOCAB = range(2, 400)  # the tiny tokenizer's ids without <s> and </s>

PROBE = '''"""Test probe: one JSON line per preemption made by vLLM's scheduler."""
import json
import os
import sys

_LOG = os.environ.get("NEXUS_TEST_PREEMPT_LOG")
_TARGET = "vllm.v1.core.sched.scheduler"


def _patch(scheduler_cls):
    orig = scheduler_cls._preempt_request

    def _preempt_request(self, request, *args, **kwargs):
        line = {"seed": getattr(request.sampling_params, "seed", None),
                "output_tokens": int(request.num_output_tokens),
                "computed_tokens": int(request.num_computed_tokens),
                # vLLM's running list (admission order), the victim popped off its end.
                "running": [getattr(r.sampling_params, "seed", None)
                            for r in getattr(self, "running", [])]}
        with open(_LOG, "a") as fh:
            fh.write(json.dumps(line) + "\\n")
        return orig(self, request, *args, **kwargs)

    scheduler_cls._preempt_request = _preempt_request


class _Finder:
    """Patches the scheduler module right after it is first imported (engine core)."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module.Scheduler)

        spec.loader.exec_module = exec_and_patch
        return spec


if _LOG:
    sys.meta_path.insert(0, _Finder())
'''


# -- helpers ----------------------------------------------------------------------------
def _series(server, name: str) -> float:  # noqa: ANN001
    """Sum of all samples of one series (0 when absent: counters appear on first use)."""
    return server.metrics().total(name)


def _wait_idle(server, timeout: float = 60.0) -> None:  # noqa: ANN001
    """Wait until no request runs or waits (an abort reaches the engine a step later)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if (m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0
                and m.get("vllm:nexus_live_blocks", 0) == 0):
            time.sleep(1.0)  # the pool gauges ride on the same stats update
            return
        time.sleep(0.25)
    raise AssertionError(f"server not idle after {timeout}s: {server.metrics()}")


def _greedy_ids(server, prompt: list[int], max_tokens: int, seed: int,  # noqa: ANN001
                xargs: dict | None = None) -> tuple[list[int], str]:
    import requests

    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "seed": seed, "ignore_eos": True, "return_token_ids": True}
    if xargs:
        body["vllm_xargs"] = xargs
    r = requests.post(server.base_url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return list(choice["token_ids"]), str(choice["finish_reason"])


def _log_errors(server, offset: int) -> list[str]:  # noqa: ANN001
    server.log_tail(1)  # flushes
    text = server.log_path.read_text(errors="replace")[offset:]
    return [ln for ln in text.splitlines() if re.search(r"\bERROR\b|Traceback", ln)]


def _log_size(server) -> int:  # noqa: ANN001
    server.log_tail(1)
    return len(server.log_path.read_text(errors="replace"))


@pytest.fixture(scope="module")
def server(tiny_model, serve_tmp):  # noqa: ANN001, ANN201
    from nexus_vllm.eval.server import VllmServer

    probe_dir = serve_tmp / "preempt_probe"
    probe_dir.mkdir(exist_ok=True)
    (probe_dir / "sitecustomize.py").write_text(PROBE)
    log = serve_tmp / "preemptions.jsonl"
    log.write_text("")
    pythonpath = os.pathsep.join(filter(None, [str(probe_dir), os.environ.get("PYTHONPATH")]))
    srv = VllmServer(tiny_model, SERVER_ARGS, serve_tmp, env={
        "PYTHONPATH": pythonpath, "NEXUS_TEST_PREEMPT_LOG": str(log),
        "NEXUS_VLLM_SELF_CHECK": "1"})
    srv.preempt_log = log
    # The pool gauges are published with the first engine step.
    _greedy_ids(srv, [5, 6, 7, 8], 4, seed=0)
    yield srv
    srv.stop()


# -- 3. the short soak (first: it runs its own server) ------------------------------------
def test_short_soak(tiny_model, tmp_path) -> None:  # noqa: ANN001
    """``scripts/soak.py`` on the tiny model with a small pool (preemption, admission
    waits and cancellation together): exit status 0, no errors, no leaked blocks, no
    faults, and resident memory within a generous bound."""
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO / "scripts" / "soak.py"), "--model", tiny_model,
           "--requests", "60", "--concurrency", "16", "--prompt-tokens", "100,1500",
           "--max-tokens", "16,64", "--cancel-fraction", "0.3", "--seed", "3",
           "--kv-cache-gib", "1", "--server-args=" + " ".join(SERVER_ARGS),
           "--output", str(out), "--log-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["completed"] + r["cancelled"] == r["requests"] == 60
    assert r["cancelled"] > 0 and r["completed"] > 0
    assert r["errors"] == 0 and r["server_log_errors"] == 0
    assert r["leaked_blocks"] == 0 and r["free_blocks_end"] == r["total_blocks"]
    assert r["kv_cache_usage_perc_end"] == 0.0 and r["live_blocks_end"] == 0.0
    assert r["faults_total"] == 0, r["faults"]
    assert r["evicted_blocks"] > 0 and r["probe_unchanged"]
    # Generous: allocator warm-up moves RSS by ~100-200 MiB on this model.
    growth = r["rss_end_mib"] - r["rss_start_mib"]
    assert growth < max(512.0, 0.5 * r["rss_start_mib"]), (r["rss_start_mib"], r["rss_end_mib"])


# -- 1. cancellation -----------------------------------------------------------------------
async def _cancel_storm(server, specs: list[dict], concurrency: int) -> list[str]:  # noqa: ANN001
    """Send every spec as a stream and drop it at its cancel point; return each outcome."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession, spec: dict) -> str:
        async def stream() -> str:
            async with session.post(server.base_url + spec["path"], json=spec["body"]) as r:
                if r.status != 200:
                    return f"error: HTTP {r.status} {(await r.text())[:200]}"
                if spec["after_chunks"] == 0:
                    r.close()  # headers only: closed before the first token
                    return "closed before the first token"
                n = 0
                async for line in r.content:
                    if line.startswith(b"data:") and b"[DONE]" not in line:
                        n += 1
                        if n >= spec["after_chunks"]:
                            r.close()
                            return "closed mid-stream"
                return "finished"

        async with sem:
            if spec["after_seconds"] is None:
                return await stream()
            try:  # drop the request before its response headers arrive, if it is quick
                return await asyncio.wait_for(stream(), spec["after_seconds"])
            except asyncio.TimeoutError:
                return "cancelled before the response"

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return list(await asyncio.gather(*(one(session, s) for s in specs)))


def _cancel_specs(server, tokenizer, n: int, rng: random.Random) -> list[dict]:  # noqa: ANN001
    from tests.integration.tiny_model import _CORPUS

    # Chat prompts are text: slices of the tokenizer's own training sentences, which
    # re-encode to the same length (decoded random ids re-encode up to 1.8x longer).
    text_ids = tokenizer(" ".join(rng.choice(_CORPUS) for _ in range(300)))["input_ids"]
    specs = []
    for i in range(n):
        length = rng.randint(100, 1500)
        start = rng.randint(0, len(text_ids) - length)
        xargs = {"kv_eviction": rng.choice(METHODS), "kv_budget": rng.choice(BUDGETS)}
        # ignore_eos: every stream is 48 tokens long, longer than any cancel point.
        body = {"model": server.model, "max_tokens": 48, "ignore_eos": True, "stream": True,
                "temperature": 0.8, "seed": i, "vllm_xargs": xargs}
        if i % 2:
            path = "/v1/chat/completions"
            text = tokenizer.decode(text_ids[start:start + length])
            body["messages"] = [{"role": "user", "content": text}]
        else:
            path = "/v1/completions"
            body["prompt"] = [rng.choice(VOCAB) for _ in range(length)]
        u = rng.random()
        after_seconds, after_chunks = None, rng.randint(1, 40)
        if u < 0.1:
            after_seconds = rng.uniform(0.0, 0.05)
        elif u < 0.25:
            after_chunks = 0
        specs.append({"path": path, "body": body, "after_seconds": after_seconds,
                      "after_chunks": after_chunks})
    return specs


def test_cancelled_streams_return_every_block(server, tiny_model) -> None:  # noqa: ANN001
    """200 streams, 24 at a time, each dropped at a random point (some before their
    response, some before their first token), with random per-request methods and budgets:
    afterwards the pool is exactly as full as before, vLLM reports zero KV usage, no
    live blocks, no faults, no ERROR log line, and a greedy request gives the same tokens
    as before the storm."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    probe_prompt = [7, 11, 13, 17] * 60
    ref, _ = _greedy_ids(server, probe_prompt, 24, seed=1)
    _wait_idle(server)
    before = server.metrics()
    faults_before = _series(server, "vllm:nexus_faults_total")
    log_offset = _log_size(server)
    assert before["vllm:nexus_free_blocks"] == before["vllm:nexus_total_blocks"] == POOL_BLOCKS - 1

    specs = _cancel_specs(server, tokenizer, 200, random.Random(1234))
    t0 = time.monotonic()
    outcomes = asyncio.run(_cancel_storm(server, specs, concurrency=24))
    storm_s = time.monotonic() - t0
    counts = {k: outcomes.count(k) for k in sorted(set(outcomes))}
    print(f"cancellation storm: {storm_s:.1f}s {counts}")
    assert not [o for o in outcomes if o.startswith("error")], counts
    # The test exercises what it claims: each way of cancelling happened.
    assert counts.get("closed mid-stream", 0) >= 100
    assert counts.get("closed before the first token", 0) >= 10
    assert counts.get("cancelled before the response", 0) >= 1

    _wait_idle(server)
    after = server.metrics()
    print(f"preemptions so far {after.get('vllm:num_preemptions_total')}, evicted "
          f"{after['vllm:nexus_evicted_blocks_total'] - before.get('vllm:nexus_evicted_blocks_total', 0)}")
    assert after["vllm:nexus_free_blocks"] == before["vllm:nexus_free_blocks"]
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert after["vllm:nexus_live_blocks"] == 0.0
    assert after["vllm:nexus_evicted_blocks_total"] > before.get(
        "vllm:nexus_evicted_blocks_total", 0.0)
    assert _series(server, "vllm:nexus_faults_total") == faults_before
    assert _log_errors(server, log_offset) == []
    # Still serving, and unchanged.
    assert _greedy_ids(server, probe_prompt, 24, seed=1)[0] == ref


# -- 2. preemption -------------------------------------------------------------------------
def _preemptions(server, offset: int) -> list[dict]:  # noqa: ANN001
    lines = server.preempt_log.read_text().splitlines()[offset:]
    return [json.loads(ln) for ln in lines]


# Preemption by construction (see the test's docstring): three non-evicting requests of
# N_TOKENS tokens each, and an evicting sentinel that outlives them.
N_TOKENS = 31 * BLOCK  # 992: 31 blocks each at the end, 93 together (< the 95 usable)
SENTINEL_BUDGET = 512  # 16 blocks always live once past it; admitted with 20 free


def _wait_running(server, n: int, timeout: float = 120.0) -> None:  # noqa: ANN001
    """Wait until vLLM's scheduler has (at least) ``n`` requests in its running list."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metrics().get("vllm:num_requests_running", 0) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"fewer than {n} requests running after {timeout}s: "
                         f"{server.metrics()}")


def test_preempted_requests_finish_and_replay(server) -> None:  # noqa: ANN001
    """Three long non-evicting requests, then an evicting sentinel, then seven more seeded
    evicting ones (long prompts) overfill the 95-block pool, so vLLM preempts, and its
    first victim is an evicting request in every interleaving. Every request finishes
    with all its tokens; then each is sent alone (same server, one at a time: nothing to
    preempt, and the same process and kernels, so the only difference is the
    preemption). A request that was never preempted after its first token gives exactly
    its tokens alone; one preempted after generating G tokens gives the same first G
    tokens (module docstring: why later tokens may differ).

    Why the first preemption hits an evicting request whatever the timing. vLLM 0.32
    (FCFS) preempts only when a *running* request cannot get a block, and then preempts
    ``running[-1]``, the most recently admitted running request (``running`` keeps
    admission order; a waiting request never preempts). The plugin admits an evicting
    request only when the free pool covers its bound on top of the other evicting
    requests' outstanding growth, and ignores non-evicting ones.

    1. Order: the evicting requests are sent only once the three non-evicting ones are in
       ``running`` (``_wait_running``), and no request is re-admitted before the first
       preemption, so until then every running evicting request is behind every
       non-evicting one in ``running``.
    2. The non-evicting requests alone never fill the pool: each ends at N_TOKENS = 31
       blocks, 93 < 95 together. So no allocation fails while no evicting request runs;
       the first one that fails has an evicting request running, ``running[-1]`` is one,
       and it is the victim (``events[0]`` below).
    3. A preemption does happen. The sentinel (budget 512: 16 blocks, bound 20) is sent
       once the three are running (~48 blocks after their prompts) and is admitted at
       once (it fits until they pass 75 blocks, ~290 decode steps later). Every running
       request is scheduled every step (at most 11 * 128 tokens, under the 2048-token
       step budget), and the sentinel's 9 prompt chunks + 560 decode steps outlast each
       non-evicting request's <= 4 chunks + <= 522 steps, all started before it. So on
       the step the first non-evicting request reaches its 31st block, the sentinel
       still runs (or was preempted already) holding >= 16 blocks (an event never keeps
       fewer than the budget), while the three hold >= 80 (sent together, they start
       within far fewer than ~190 steps of each other): 96 > 95 blocks cannot be held, so
       a preemption came first. The seven later evicting requests only add pressure.
    """
    import concurrent.futures as cf

    rng = random.Random(99)
    pressure = []
    for i in range(3):
        n = rng.randint(470, 490)
        pressure.append((10_000 + i, [rng.choice(VOCAB) for _ in range(n)], N_TOKENS - n,
                         {"kv_eviction": "none"}))
    sentinel = (20_000, [rng.choice(VOCAB) for _ in range(1100)], 560,
                {"kv_eviction": "nexus", "kv_budget": SENTINEL_BUDGET})
    others = []
    for i in range(1, 8):
        xargs = {"kv_eviction": METHODS[i % 4], "kv_budget": BUDGETS[i % 3]}
        others.append((20_000 + i, [rng.choice(VOCAB) for _ in range(rng.randint(1000, 1500))],
                       rng.randint(40, 80), xargs))
    reqs = [*pressure, sentinel, *others]
    evicting = {seed for seed, *_ in reqs if seed >= 20_000}

    _wait_idle(server)
    offset = len(server.preempt_log.read_text().splitlines())
    p0 = _series(server, "vllm:num_preemptions_total")
    e0 = _series(server, "vllm:nexus_evicted_blocks_total")

    def send(req: tuple, delay: float = 0.0) -> tuple[list[int], str]:
        seed, prompt, max_tokens, xargs = req
        time.sleep(delay)
        return _greedy_ids(server, prompt, max_tokens, seed, xargs)

    # At most 11 requests * 128-token chunks per step: below vLLM's 2048-token step
    # budget, so no chunk is ever cut short by other requests' tokens.
    with cf.ThreadPoolExecutor(len(reqs)) as pool:
        futs = [pool.submit(send, r) for r in pressure]
        _wait_running(server, len(pressure))
        futs.append(pool.submit(send, sentinel))
        _wait_running(server, len(pressure) + 1)
        futs += [pool.submit(send, r, 0.05 * i) for i, r in enumerate(others)]
        busy = [f.result() for f in futs]
    _wait_idle(server)
    events = _preemptions(server, offset)
    p1 = _series(server, "vllm:num_preemptions_total")
    assert _series(server, "vllm:nexus_evicted_blocks_total") > e0

    for (seed, _, max_tokens, _), (tokens, reason) in zip(reqs, busy):
        assert reason == "length" and len(tokens) == max_tokens, (seed, reason, len(tokens))
    # The probe saw every preemption vLLM counted; the first hit an evicting request.
    assert p1 - p0 == len(events) > 0
    assert events[0]["seed"] in evicting, events

    alone = [send(r, 0.0) for r in reqs]
    assert _series(server, "vllm:num_preemptions_total") == p1  # alone: nothing preempted
    exact, prefix_only = 0, []
    for (seed, *_), (tokens, _), (ref, _) in zip(reqs, busy, alone):
        mid_decode = [e["output_tokens"] for e in events
                      if e["seed"] == seed and e["output_tokens"] > 0]
        if not mid_decode:
            assert tokens == ref, seed
            exact += 1
        else:
            generated = min(mid_decode)
            assert tokens[:generated] == ref[:generated], (seed, generated)
            first_diff = next((j for j, (x, y) in enumerate(zip(tokens, ref)) if x != y), None)
            prefix_only.append((seed, generated, first_diff))
    # (seed, tokens before the preemption, first differing token or None)
    print(f"preemptions {len(events)}: {events}; exact {exact}, preempted while decoding "
          f"{prefix_only}")
    m = server.metrics()
    assert m["vllm:nexus_free_blocks"] == m["vllm:nexus_total_blocks"]
    assert m["vllm:kv_cache_usage_perc"] == 0.0
