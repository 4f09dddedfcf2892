#!/usr/bin/env python
"""Soak test: many streaming requests against an evicting ``vllm serve``, some cancelled.

By default it starts ``vllm serve`` on 127.0.0.1 itself (the embedded SmolLM2-135M with
``--kv-eviction nexus``), sends ``--requests`` requests ``--concurrency`` at a time with
random prompt lengths, budgets, methods and endpoints (chat / completions), cancels a
fraction of them at a random point of their stream (some before the first token), and
then checks that the server is back where it started: no leaked KV blocks, vLLM's KV
usage at 0, no errors. Prints a markdown table, writes a JSON result, and exits non-zero
on any error, leak or server-log ERROR line.

    .venv/bin/python scripts/soak.py                          # 1,000 requests, SmolLM2
    .venv/bin/python scripts/soak.py --model DIR --requests 60 --concurrency 16
    .venv/bin/python scripts/soak.py --base-url http://127.0.0.1:8000   # a running server

Prompts are slices of a seeded word-list text, tokenized once by the server's own
``/tokenize`` (completions get token ids of the exact length; chat gets the slice's text
from ``/detokenize``), so nothing is downloaded and the lengths are exact for any model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import random
import re
import shlex
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import requests

from nexus_vllm.eval.server import read_metrics


def request_methods() -> tuple[str, ...]:
    """The ``kv_eviction`` values a request may send: every policy the plugin serves (read
    from the policy registry when asked) and ``none``; ``default`` sends no vllm_xargs
    (the server's own config). A policy with a per-head score only is not served (the
    server pages blocks), so it is left out."""
    from nexus_vllm.core.policies import POLICIES

    return ("default", *(m for m, cls in POLICIES.items() if not cls.head_only), "none")


def request_budgets() -> tuple[int, ...]:
    """The ``kv_budget`` values a request may send: the least the server's default config
    allows (its always-kept blocks, :attr:`EvictionConfig.forced_tokens`), then 256, 384
    and 512."""
    from nexus_vllm.core import EvictionConfig

    return (EvictionConfig().forced_tokens, 256, 384, 512)


# Server flags of the default run: eviction on at a budget most prompts exceed, chunks
# small enough that a prompt streams in several of them, and 64 sequences so that
# --concurrency 64 all run at once (the 2 GiB pool holds 64 requests without eviction).
DEFAULT_SERVER_ARGS = ("--kv-eviction nexus --kv-budget 256 --kv-prompt-mode stream "
                       "--kv-chunk-size 128 --kv-eviction-seed 0 --max-num-seqs 64")
_WORDS = [
    "river", "stone", "bread", "market", "window", "garden", "letter", "silver", "morning",
    "harbor", "engine", "candle", "winter", "forest", "lantern", "quiet", "copper",
    "signal", "orchard", "valley", "ticket", "mirror", "thunder", "pocket", "meadow",
    "island", "whistle", "canvas", "velvet", "ladder", "compass", "feather", "anchor",
    "basket", "cinder", "dune", "ember", "fable", "glacier", "hollow", "ivory", "jasmine",
    "kettle", "lagoon", "marble", "nectar", "opal", "pebble", "quill", "raven", "saddle",
    "tundra", "umber", "willow",
]


@dataclass
class Spec:
    """One request of the soak (drawn up front from ``--seed``)."""

    index: int
    endpoint: str  # "chat" or "completions"
    prompt_tokens: int
    max_tokens: int
    method: str
    budget: int
    temperature: float
    cancel_after: int | None  # token chunks read before closing; None: read to the end


@dataclass
class Outcome:
    """What happened to one request."""

    index: int
    status: str  # completed | cancelled | error | not_sent
    latency_s: float | None = None
    ttft_s: float | None = None
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    start_s: float | None = None  # sent, seconds after the run started
    end_s: float | None = None  # finished, cancelled or failed


@dataclass
class Snapshot:
    """Server state at one moment: the pool, vLLM's usage, faults, resident memory."""

    free_blocks: float | None
    total_blocks: float | None
    live_blocks: float | None
    kv_cache_usage_perc: float | None
    faults: dict[str, float] = field(default_factory=dict)
    preemptions: float | None = None
    evicted_blocks: float | None = None
    rss_mib: float | None = None


# -- metrics and memory ---------------------------------------------------------------
def tree_rss_mib(pid: int | None) -> float | None:
    """Resident memory of ``pid`` and all its descendants, in MiB (None: unknown)."""
    if pid is None:
        return None
    try:
        import psutil
    except ImportError:
        return _proc_tree_rss_mib(pid)
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total / 2**20


def own_rss_mib(pid: int | None) -> float | None:
    """Resident memory of ``pid`` alone (the API server; the rest of the tree is the
    engine core and its workers), in MiB."""
    if pid is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def _proc_tree_rss_mib(pid: int) -> float | None:
    """The same from /proc (no psutil): parent links from ``stat``, VmRSS from ``status``."""
    parents: dict[int, int] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                # The command name may hold spaces; the fields after ')' do not.
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(stat[1])
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in tree:
                tree.add(child)
                frontier.append(child)
    total_kib = 0
    for p in tree:
        with contextlib.suppress(OSError):
            for line in pathlib.Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
    return total_kib / 1024 if total_kib else None


def snapshot(base_url: str, pid: int | None) -> Snapshot:
    m = read_metrics(base_url)
    return Snapshot(
        free_blocks=m.get("vllm:nexus_free_blocks"),
        total_blocks=m.get("vllm:nexus_total_blocks"),
        live_blocks=m.get("vllm:nexus_live_blocks"),
        kv_cache_usage_perc=m.get("vllm:kv_cache_usage_perc"),
        faults=m.by_label("vllm:nexus_faults_total", "kind"),
        preemptions=m.get("vllm:num_preemptions_total"),
        evicted_blocks=m.get("vllm:nexus_evicted_blocks_total"),
        rss_mib=tree_rss_mib(pid),
    )


def wait_idle(base_url: str, timeout: float = 120.0) -> bool:
    """Wait until vLLM reports no running or waiting request (aborts take a step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = read_metrics(base_url)
        busy = (m.get("vllm:num_requests_running") or 0) + (
            m.get("vllm:num_requests_waiting") or 0)
        if busy == 0 and not m.get("vllm:nexus_live_blocks"):
            # The pool gauges ride on the same stats update; one more beat for the
            # API server to export it.
            time.sleep(1.0)
            return True
        time.sleep(0.5)
    return False


class RssSampler:
    """Samples the server tree's RSS every ``period`` seconds while the soak runs, so a
    steady climb (a leak) is told apart from one step up (allocator warm-up). Each sample
    is (seconds, tree MiB, API-server MiB): the difference is the engine core."""

    def __init__(self, pid: int | None, period: float = 5.0) -> None:
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, float, float | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            rss, api = tree_rss_mib(self.pid), own_rss_mib(self.pid)
            if rss is not None:
                self.samples.append((round(time.monotonic() - t0, 1), round(rss, 1),
                                     None if api is None else round(api, 1)))
            self._stop.wait(self.period)

    def __enter__(self) -> RssSampler:
        if self.pid is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


# -- prompts --------------------------------------------------------------------------
def corpus_ids(base_url: str, model: str, num_tokens: int, rng: random.Random) -> list[int]:
    """Token ids of a seeded word-list text at least ``num_tokens`` long."""
    words: list[str] = []
    ids: list[int] = []
    while len(ids) < num_tokens:
        for _ in range(max(256, num_tokens - len(ids))):
            words.append(rng.choice(_WORDS))
            if rng.random() < 0.08:
                words[-1] += "."
        r = requests.post(base_url + "/tokenize", timeout=60,
                          json={"model": model, "prompt": " ".join(words),
                                "add_special_tokens": False})
        r.raise_for_status()
        ids = r.json()["tokens"]
    return ids


def draw_specs(args: argparse.Namespace, rng: random.Random) -> list[Spec]:
    lo, hi = args.prompt_tokens
    tlo, thi = args.max_tokens
    specs = []
    for i in range(args.requests):
        cancel = rng.random() < args.cancel_fraction
        max_tokens = rng.randint(tlo, thi)
        specs.append(Spec(
            index=i, endpoint=rng.choice(args.endpoints),
            prompt_tokens=rng.randint(lo, hi), max_tokens=max_tokens,
            method=rng.choice(args.methods), budget=rng.choice(args.budgets),
            temperature=rng.choice(args.temperatures),
            # 0 closes the stream before the first token arrives.
            cancel_after=rng.randint(0, max_tokens - 1) if cancel else None,
        ))
    return specs


def build_bodies(specs: list[Spec], ids: list[int], base_url: str, model: str,
                 seed: int, rng: random.Random) -> list[dict[str, Any]]:
    bodies = []
    for s in specs:
        start = rng.randint(0, len(ids) - s.prompt_tokens)
        prompt = ids[start:start + s.prompt_tokens]
        body: dict[str, Any] = {"model": model, "max_tokens": s.max_tokens, "stream": True,
                                "temperature": s.temperature, "seed": seed + s.index}
        if s.method != "default":
            body["vllm_xargs"] = {"kv_eviction": s.method, "kv_budget": s.budget}
        if s.endpoint == "completions":
            body["prompt"] = prompt
        else:
            r = requests.post(base_url + "/detokenize", json={"model": model, "tokens": prompt},
                              timeout=60)
            r.raise_for_status()
            body["messages"] = [{"role": "user", "content": r.json()["prompt"]}]
        bodies.append(body)
    return bodies


# -- one streaming request ------------------------------------------------------------
async def run_one(session: Any, base_url: str, spec: Spec, body: dict[str, Any],
                  timeout: float) -> Outcome:
    import aiohttp

    path = "/v1/completions" if spec.endpoint == "completions" else "/v1/chat/completions"
    t0 = time.monotonic()
    out = Outcome(index=spec.index, status="error")
    try:
        async with session.post(base_url + path, json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            if spec.cancel_after == 0:
                resp.close()  # drop the connection: the server must abort the request
                out.status = "cancelled"
                return out
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"stream error: {str(chunk['error'])[:300]}"
                    return out
                for choice in chunk.get("choices", []):
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if piece:
                        if out.tokens == 0:
                            out.ttft_s = time.monotonic() - t0
                        out.tokens += 1
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
                if spec.cancel_after is not None and out.tokens >= spec.cancel_after:
                    resp.close()
                    out.status = "cancelled"
                    return out
            if not done:
                out.error = "stream ended without [DONE]"
            elif out.finish_reason not in ("stop", "length"):
                out.error = f"finish_reason {out.finish_reason!r}"
            else:
                out.status = "completed"
                out.latency_s = time.monotonic() - t0
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    return out


async def run_all(args: argparse.Namespace, base_url: str, specs: list[Spec],
                  bodies: list[dict[str, Any]]) -> list[Outcome]:
    import aiohttp
    from tqdm import tqdm

    sem = asyncio.Semaphore(args.concurrency)
    t_run = time.monotonic()
    deadline = t_run + args.max_seconds
    bar = tqdm(total=len(specs), desc="soak", unit="req", dynamic_ncols=True,
               mininterval=1.0 if sys.stderr.isatty() else 30.0)
    counts = {"completed": 0, "cancelled": 0, "error": 0, "not_sent": 0}

    async def worker(spec: Spec, body: dict[str, Any]) -> Outcome:
        async with sem:
            if time.monotonic() > deadline:
                out = Outcome(index=spec.index, status="not_sent")
            else:
                t0 = time.monotonic() - t_run
                out = await run_one(session, base_url, spec, body, args.request_timeout)
                out.start_s, out.end_s = round(t0, 2), round(time.monotonic() - t_run, 2)
        counts[out.status] += 1
        bar.set_postfix(counts, refresh=False)
        bar.update(1)
        return out

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        outcomes = await asyncio.gather(*(worker(s, b) for s, b in zip(specs, bodies)))
    bar.close()
    return list(outcomes)


# -- the whole run --------------------------------------------------------------------
def probe(base_url: str, model: str) -> list[int]:
    """A fixed greedy request: its tokens before and after the soak must be equal."""
    r = requests.post(base_url + "/v1/completions", timeout=300, json={
        "model": model, "prompt": "The river stone market opens at dawn, and the",
        "max_tokens": 16, "temperature": 0.0, "return_token_ids": True})
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


def machine() -> dict[str, Any]:
    """CPU count and model, and the load average (the box may be shared)."""
    model = None
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpus": os.cpu_count(), "cpu_model": model,
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def log_errors(log_path: pathlib.Path | None) -> list[str]:
    if log_path is None or not log_path.exists():
        return []
    lines = log_path.read_text(errors="replace").splitlines()
    return [ln for ln in lines if re.search(r"\bERROR\b|Traceback", ln)]


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def per_minute(times: Any) -> list[int]:
    counts: list[int] = []
    for t in times:
        if t is None:
            continue
        minute = int(t // 60)
        counts.extend([0] * (minute + 1 - len(counts)))
        counts[minute] += 1
    return counts


def summarize(args: argparse.Namespace, outcomes: list[Outcome], start: Snapshot,
              end: Snapshot, extra: dict[str, Any]) -> dict[str, Any]:
    by = {k: [o for o in outcomes if o.status == k]
          for k in ("completed", "cancelled", "error", "not_sent")}
    lat = [o.latency_s for o in by["completed"] if o.latency_s is not None]
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    leaked = None
    if start.free_blocks is not None and end.free_blocks is not None:
        leaked = int(start.free_blocks - end.free_blocks)
    faults = {k: end.faults.get(k, 0.0) - start.faults.get(k, 0.0)
              for k in set(start.faults) | set(end.faults)}
    faults = {k: v for k, v in faults.items() if v}

    def delta(a: float | None, b: float | None) -> float | None:
        # A counter is absent from /metrics until it first moves: absent means 0.
        return None if b is None else b - (a or 0.0)

    return {
        "requests": len(outcomes), "completed": len(by["completed"]),
        "cancelled": len(by["cancelled"]), "errors": len(by["error"]),
        "not_sent": len(by["not_sent"]),
        "error_samples": [o.error for o in by["error"]][:10],
        "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tokens_streamed": sum(o.tokens for o in outcomes),
        # Requests finished (completed or cancelled) in each minute of the run: a falling
        # rate with a steady load average is a server slowing down.
        "finished_per_minute": per_minute(o.end_s for o in outcomes
                                          if o.status in ("completed", "cancelled")),
        "leaked_blocks": leaked, "free_blocks_start": start.free_blocks,
        "free_blocks_end": end.free_blocks, "total_blocks": end.total_blocks,
        "live_blocks_end": end.live_blocks,
        "kv_cache_usage_perc_end": end.kv_cache_usage_perc,
        "faults": faults, "faults_total": sum(faults.values()),
        "preemptions": delta(start.preemptions, end.preemptions),
        "evicted_blocks": delta(start.evicted_blocks, end.evicted_blocks),
        "rss_start_mib": start.rss_mib, "rss_end_mib": end.rss_mib,
        **extra,
        "start": asdict(start), "end": asdict(end),
        "config": dict(vars(args)),
        "outcomes": [asdict(o) for o in outcomes],
    }


def failures(result: dict[str, Any]) -> list[str]:
    """Why the run failed (empty: it passed)."""
    out = []
    if result["errors"]:
        out.append(f"{result['errors']} request errors")
    if result["leaked_blocks"]:
        out.append(f"{result['leaked_blocks']} leaked KV blocks")
    if result["kv_cache_usage_perc_end"]:
        out.append(f"vLLM KV usage {result['kv_cache_usage_perc_end']} at the end (not 0)")
    if result["live_blocks_end"]:
        out.append(f"{result['live_blocks_end']} live blocks at the end")
    if not result["idle"]:
        out.append("the server did not go idle after the run")
    if result["server_log_errors"]:
        out.append(f"{result['server_log_errors']} ERROR/Traceback lines in the server log")
    if not result["probe_unchanged"]:
        out.append("the greedy probe request changed its tokens after the soak")
    return out


def markdown(result: dict[str, Any]) -> str:
    def fmt(v: Any, unit: str = "", nd: int = 2) -> str:
        if v is None:
            return "n/a"
        return f"{v:.{nd}f}{unit}" if isinstance(v, float) else f"{v}{unit}"

    rows = [
        ("requests (completed / cancelled / not sent)",
         f"{result['requests']} ({result['completed']} / {result['cancelled']} / "
         f"{result['not_sent']})"),
        ("errors", fmt(result["errors"])),
        ("latency p50 / p99 (completed)",
         f"{fmt(result['latency_p50_s'], ' s')} / {fmt(result['latency_p99_s'], ' s')}"),
        ("time to first token p50 / p99",
         f"{fmt(result['ttft_p50_s'], ' s')} / {fmt(result['ttft_p99_s'], ' s')}"),
        ("leaked blocks (free at start - free at end)",
         f"{fmt(result['leaked_blocks'])} ({fmt(result['free_blocks_start'], nd=0)} - "
         f"{fmt(result['free_blocks_end'], nd=0)} of {fmt(result['total_blocks'], nd=0)})"),
        ("vLLM kv_cache_usage_perc at the end", fmt(result["kv_cache_usage_perc_end"])),
        ("faults (vllm:nexus_faults_total)", fmt(result["faults_total"], nd=0)),
        ("server-log ERROR lines", fmt(result["server_log_errors"])),
        ("preemptions / evicted blocks",
         f"{fmt(result['preemptions'], nd=0)} / {fmt(result['evicted_blocks'], nd=0)}"),
        ("server RSS start / end",
         f"{fmt(result['rss_start_mib'], ' MiB', 0)} / {fmt(result['rss_end_mib'], ' MiB', 0)}"),
        ("wall time (requests)", fmt(result["wall_seconds"], " s", 1)),
    ]
    lines = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    return "\n".join(lines)


def _pair(kind: type) -> Any:
    def parse(text: str) -> tuple[Any, Any]:
        parts = text.split(",")
        if len(parts) != 2:
            raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}")
        lo, hi = (kind(p) for p in parts)
        if not 0 < lo <= hi:
            raise argparse.ArgumentTypeError(f"expected 0 < MIN <= MAX, got {text!r}")
        return lo, hi
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="model to serve; unset: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--base-url", default=None,
                   help="use this running server instead of starting one")
    p.add_argument("--server-pid", type=int, default=None,
                   help="with --base-url: the server's pid, for its resident memory")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                   help="vllm serve flags after the CPU defaults (a shell-quoted string)")
    p.add_argument("--kv-cache-gib", type=int, default=2,
                   help="VLLM_CPU_KVCACHE_SPACE of the started server")
    p.add_argument("--requests", type=int, default=1000, help="requests to send")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    p.add_argument("--max-seconds", type=float, default=3600.0,
                   help="send no new request after this long (in-flight ones finish)")
    # 64-512 rather than 64-1024: 1,000 requests at up to 1,024 prompt tokens measured
    # ~46 min on a 2-core CPU; this keeps the default run well under that (docs/reliability.md).
    p.add_argument("--prompt-tokens", type=_pair(int), default=(64, 512), metavar="MIN,MAX",
                   help="prompt length range, in tokens")
    p.add_argument("--max-tokens", type=_pair(int), default=(16, 64), metavar="MIN,MAX",
                   help="max_tokens range of a request")
    p.add_argument("--endpoints", type=lambda s: tuple(s.split(",")),
                   default=("chat", "completions"),
                   help="comma list of chat, completions (completions only for a base model "
                        "without a chat template)")
    p.add_argument("--cancel-fraction", type=float, default=0.2,
                   help="share of requests closed at a random point of their stream")
    methods = request_methods()
    p.add_argument("--methods", type=lambda s: s.split(","), default=list(methods),
                   help="kv_eviction values drawn per request (default: no vllm_xargs)")
    p.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")],
                   default=list(request_budgets()),
                   help="kv_budget values drawn per request (default: %(default)s)")
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.0, 0.8],
                   help="temperature values drawn per request (sampled ones carry a seed)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the draws, the prompts and each request's sampling seed")
    p.add_argument("--request-timeout", type=float, default=900.0,
                   help="seconds before one request counts as an error")
    p.add_argument("--output", default="runs/soak/soak_result.json",
                   help="JSON result (also holds every request's outcome)")
    p.add_argument("--log-dir", default=None,
                   help="where the started server writes its log (default: a temp dir)")
    args = p.parse_args(argv)
    if not 0.0 <= args.cancel_fraction <= 1.0:
        p.error("--cancel-fraction must be in [0, 1]")
    if args.requests < 1 or args.concurrency < 1:
        p.error("--requests and --concurrency must be positive")
    if bad := [m for m in args.methods if m not in methods]:
        p.error(f"--methods: unknown {bad}; choose from {', '.join(methods)}")
    if not args.endpoints or set(args.endpoints) - {"chat", "completions"}:
        p.error(f"--endpoints: choose from chat, completions; got {','.join(args.endpoints)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    server = None
    log_path: pathlib.Path | None = None
    try:
        if args.base_url:
            base_url, pid = args.base_url.rstrip("/"), args.server_pid
        else:
            from nexus_vllm.eval.server import VllmServer

            model = args.model
            if model is None:
                from nexus_vllm.models import default_model_path

                model = str(default_model_path())
            log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="nexus_soak_"))
            log_dir.mkdir(parents=True, exist_ok=True)
            print(f"starting vllm serve {model} {args.server_args} (log in {log_dir})",
                  file=sys.stderr, flush=True)
            server = VllmServer(model, shlex.split(args.server_args), log_dir,
                                env={"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)})
            base_url, pid, log_path = server.base_url, server.proc.pid, server.log_path
            print(f"server ready in {server.startup_seconds:.0f}s", file=sys.stderr)
        model = requests.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        specs = draw_specs(args, rng)
        ids = corpus_ids(base_url, model, args.prompt_tokens[1] * 4, rng)
        bodies = build_bodies(specs, ids, base_url, model, args.seed, rng)
        # The warm-up probe also makes the engine publish its pool gauges.
        before = probe(base_url, model)
        idle_start = wait_idle(base_url)
        start = snapshot(base_url, pid)
        machine_start = machine()
        t0 = time.monotonic()
        with RssSampler(pid) as rss:
            outcomes = asyncio.run(run_all(args, base_url, specs, bodies))
        wall = time.monotonic() - t0
        idle = wait_idle(base_url)
        end = snapshot(base_url, pid)
        after = probe(base_url, model)
        errors = log_errors(log_path)
        result = summarize(args, outcomes, start, end, {
            "rss_peak_mib": max((m for _, m, _ in rss.samples), default=None),
            "rss_samples": rss.samples,
            "machine_start": machine_start, "machine_end": machine(),
            "wall_seconds": wall, "idle": idle_start and idle, "model": model,
            "probe_unchanged": before == after,
            "server_log_errors": len(errors), "server_log_error_samples": errors[:20],
            "server_log": str(log_path) if log_path else None,
            "server_started_here": server is not None,
        })
    finally:
        if server is not None:
            server.stop()
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    problems = failures(result)
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    print(f"result: {out}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
