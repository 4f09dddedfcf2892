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
SERVER_ARGS = ["--kv-eviction", "nexus", "--kv-budget", "256", "--kv-prompt-mode", "stream",
               "--kv-chunk-size", "128",
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
                xargs: dict | None = None, priority: int = 0) -> tuple[list[int], str]:
    import requests

    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "seed": seed, "ignore_eos": True, "return_token_ids": True,
            "priority": priority}
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
    # Priority scheduling: the preemption test picks its victims by priority (requests
    # without one all have priority 0, which is first come, first served).
    srv = VllmServer(tiny_model, [*SERVER_ARGS, "--scheduling-policy", "priority"], serve_tmp,
                     env={"PYTHONPATH": pythonpath, "NEXUS_TEST_PREEMPT_LOG": str(log),
                          "NEXUS_VLLM_SELF_CHECK": "1"})
    srv.preempt_log = log
    # The pool gauges are published with the first engine step.
    _greedy_ids(srv, [5, 6, 7, 8], 4, seed=0)
    yield srv
    srv.stop()


# -- 3. the short soak (first: it runs its own server) ------------------------------------
@pytest.mark.long
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
# N_TOKENS tokens each, an evicting sentinel that outlives them, and seven more evicting
# requests. Evicting requests have the lower priority, so vLLM preempts them first.
N_TOKENS = 31 * BLOCK  # 992: 31 blocks each at the end, 93 together (< the 95 usable)
SENTINEL_BUDGET = 512  # 16 blocks always live once past it; admitted with 20 free
SENTINEL_PROMPT, SENTINEL_OUTPUT = 600, 1400  # 19 blocks of prompt: >= 16 live throughout
EVICTING_PRIORITY = 1  # vLLM: a larger value is a lower priority


def _wait_first_token(server, fut, before: float, timeout: float = 300.0) -> None:  # noqa: ANN001
    """Wait until the one request in flight, sent as ``fut``, has produced a token:
    vLLM's generated-token counter (monotonic, so no poll can miss it) passed ``before``.
    Raises at once if the request failed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _series(server, "vllm:generation_tokens_total") > before:
            return
        if fut.done():
            fut.result()  # raises the request's error
            raise AssertionError("the request finished before its first token was seen")
        time.sleep(0.05)
    raise AssertionError(f"no token generated after {timeout}s")


def test_preempted_requests_finish_and_replay(server) -> None:  # noqa: ANN001
    """An evicting sentinel, then three long non-evicting requests and seven more seeded
    evicting ones (long prompts) overfill the 95-block pool, so vLLM preempts, and every
    victim it picks while an evicting request runs is an evicting one, in every
    interleaving. Every request finishes with all its tokens; then each is sent alone
    (same server, one at a time: nothing to preempt, and the same process and kernels, so
    the only difference is the preemption). A request that was never preempted after its
    first token gives exactly its tokens alone; one preempted after generating G tokens
    gives the same first G tokens (module docstring: why later tokens may differ).

    Why the victim is an evicting request whatever the order. The server schedules by
    priority, and vLLM's priority policy preempts the running request with the largest
    ``(priority, arrival)``: evicting requests are sent with priority 1, the non-evicting
    ones with 0, so while any evicting request runs the victim is one of them. And the
    non-evicting requests alone never fill the pool (each ends at N_TOKENS = 31 blocks,
    93 < 95 together), so no allocation fails while no evicting request runs.

    Why a preemption happens. The sentinel (600-token prompt, budget 512: 16 to 20 live
    blocks from its prefill on, 1400 generated tokens) runs first, alone. The others are
    sent once it runs; the three non-evicting ones grow to 93 blocks within 4 prompt
    chunks + ~520 decode steps and pass 79 after ~380, and 80 + 16 > 95 blocks cannot be
    held, so an allocation fails while the sentinel runs, unless the three reach the
    server more than ~1000 of the sentinel's 1400 decode steps after its first token
    (one engine step per token: the only time this assumes is the client sending three
    HTTP requests in that many steps; the first token is read from a monotonic counter).
    The seven later evicting requests only add pressure.
    """
    import concurrent.futures as cf

    rng = random.Random(99)
    pressure = []
    for i in range(3):
        n = rng.randint(470, 490)
        pressure.append((10_000 + i, [rng.choice(VOCAB) for _ in range(n)], N_TOKENS - n,
                         {"kv_eviction": "none"}))
    sentinel = (20_000, [rng.choice(VOCAB) for _ in range(SENTINEL_PROMPT)], SENTINEL_OUTPUT,
                {"kv_eviction": "nexus", "kv_budget": SENTINEL_BUDGET})
    others = []
    for i in range(1, 8):
        xargs = {"kv_eviction": METHODS[i % 4], "kv_budget": BUDGETS[i % 3]}
        others.append((20_000 + i, [rng.choice(VOCAB) for _ in range(rng.randint(1000, 1500))],
                       rng.randint(40, 80), xargs))
    reqs = [sentinel, *pressure, *others]
    evicting = {seed for seed, *_ in reqs if seed >= 20_000}

    _wait_idle(server)
    offset = len(server.preempt_log.read_text().splitlines())
    p0 = _series(server, "vllm:num_preemptions_total")
    e0 = _series(server, "vllm:nexus_evicted_blocks_total")

    def send(req: tuple) -> tuple[list[int], str]:
        seed, prompt, max_tokens, xargs = req
        priority = EVICTING_PRIORITY if seed in evicting else 0
        return _greedy_ids(server, prompt, max_tokens, seed, xargs, priority)

    # At most 11 requests * 128-token chunks per step: below vLLM's 2048-token step
    # budget, so no chunk is ever cut short by other requests' tokens.
    with cf.ThreadPoolExecutor(len(reqs)) as pool:
        generated = _series(server, "vllm:generation_tokens_total")
        futs = [pool.submit(send, sentinel)]
        _wait_first_token(server, futs[0], generated)
        futs += [pool.submit(send, r) for r in [*pressure, *others]]
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

    alone = [send(r) for r in reqs]
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
