"""Serving capacity and speed: stock vLLM against vLLM with KV eviction, same model, same pool.

Starts, one after another on the same model and the same KV pool
(``--num-gpu-blocks-override``, prefix caching off everywhere):

==============  ===============================================================
config          server
==============  ===============================================================
``stock``       plain ``vllm serve`` (no eviction)
``nexus``       ``--kv-eviction nexus`` at the budget below
``snapkv`` ...  the same with a baseline policy (``--configs``; any served method)
==============  ===============================================================

and drives each with ``vllm bench serve`` (random prompts of ``--input-len`` tokens, as
far as the tokenizer re-encodes them to that length, ``--output-len`` tokens each, EOS
ignored; each row's bound follows the longest prompt sent) at each ``--concurrency`` level
(``--prompts-per-slot`` x level prompts, at least ``--min-prompts``). The budget is
``--keep`` of the input, rounded up to whole blocks; evicting servers prefill in chunks of
``--chunk`` tokens, so an evicting request never holds more than its *bound* = budget
blocks + one chunk, and is admitted only when the free pool covers that bound. Stock
vLLM admits a request when its prompt fits and preempts running requests when decode
runs out of blocks.

While each run goes, ``/metrics`` is polled: ``vllm:num_requests_running`` (the
concurrency actually reached), ``vllm:kv_cache_usage_perc`` (pool blocks in use) and, for
evicting servers, ``vllm:nexus_live_blocks_max`` (blocks of the largest request); the
deltas of ``vllm:num_preemptions_total`` and the ``vllm:nexus_*`` counters give the
preemptions, admission waits, faults and the eviction overhead (scoring + policy seconds
over engine step seconds). This module measures; it writes (``--out DIR``):

* ``runs/<config>-c<level>.json``: the ``vllm bench serve`` result and the row (the
  config name made file-safe);
* ``capacity.json``: every row, the settings, the derived pool and budget, each server's
  flags: everything the report reads.

Then ``capacity_report.py`` (next to this file) turns that JSON into ``capacity.md`` (the
table and the headline) and the plots, and with ``--update-docs`` into the section of
``docs/performance.md`` between ``<!-- serving:begin -->`` and ``<!-- serving:end -->``.
``--from-json CAPACITY_JSON`` runs only that report, from a saved run.

    python benchmarks/serving/capacity.py                       # CPU, embedded SmolLM2
    python benchmarks/serving/capacity.py --model MODEL --concurrency 8,32,128 \\
        --input-len 8192 --output-len 256 --pool-blocks 1100      # a GPU

``--smoke`` (with ``--model`` a tiny checkpoint) runs short lengths, concurrency 1,2 and one
baseline: a check of the script, not a measurement. It runs the evicting servers with
``NEXUS_VLLM_SELF_CHECK=1`` (``--self-check``): the scheduler then also counts each
request's blocks in vLLM's own block lists against its bound (``pool_*`` in the rows,
where the server exports them; a request over its bound is a ``nexus-vllm self-check``
warning in its log, counted in ``log_problems``).

The bound of an ``end`` request is its own prompt's blocks, and the random prompts are
``--input-len`` tokens only as far as the tokenizer re-encodes them to that length: the
tiny checkpoint's makes some 1025 and 1026 tokens of a 1024-token ``--input-len`` (33
blocks of 32, not 32). So each row's bound is taken at the longest prompt that level
sent (``longest_prompt``); ``derived.bound_blocks`` is the bound at ``--input-len`` only
(benchmarks/serving/pool_peaks.py reads one request's blocks in vLLM's pool).

``--workload gpu`` is the shape of serving on a GPU, per prompt mode: ~1k-token prompts
computed in one or two steps (``--max-num-batched-tokens 1024``), 128-token answers, 12
requests at once in a 161-block pool, a 256-token budget, ``stream`` (512-token chunks)
against ``end`` (the prompt chunked as vLLM chunks it), ``keep`` and stock vLLM (the
modes the README's rule for the default mode compares). There, most of a
request's life is decoding, so what a decoding request reserves decides how many run at
once (``budget.peak_from``: the budget plus one decode interval).

    python benchmarks/serving/capacity.py --workload gpu      # ~15 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import re
import shlex
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from nexus_vllm.core.budget import bound_blocks

REPO = pathlib.Path(__file__).resolve().parents[2]
# Servers without eviction. ``stock-chunked`` (opt-in) is vLLM with the evicting servers'
# prefill chunk and admission by the first chunk (``--no-scheduler-reserve-full-isl``, the
# behaviour before vLLM 0.32 reserved the full prompt at admission): it over-admits and
# preempts where ``stock`` queues.
STOCK = {
    "stock": [],
    "stock-chunked": ["--no-scheduler-reserve-full-isl", "--long-prefill-token-threshold",
                      "{chunk}"],
}
# The series summed for the faults column (every kind, every engine).
FAULTS = "vllm:nexus_faults_total"

# -- settings ---------------------------------------------------------------------------
def evicting_methods() -> tuple[str, ...]:
    """The methods a server evicts with: every policy the plugin serves, read from the
    policy registry when asked (a policy with a per-head score only is not served)."""
    from nexus_vllm.core.policies import POLICIES

    return tuple(m for m, cls in POLICIES.items() if not cls.head_only)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="HF model name or path (default: the embedded SmolLM2 checkpoint)")
    p.add_argument("--configs", default="stock,nexus,snapkv,streaming",
                   help=f"comma-separated: {', '.join(STOCK)} and any of "
                        f"{', '.join(evicting_methods())}; a method may carry "
                        "EvictionConfig knobs, "
                        "'nexus:layer_stride=2' (separate configs with ';' when knobs are "
                        "used)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated levels")
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--keep", type=float, default=0.2,
                   help="budget as a fraction of --input-len, rounded up to whole blocks")
    p.add_argument("--chunk", type=int, default=64,
                   help="prefill chunk of evicting requests (--kv-chunk-size), tokens")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="vLLM's step token budget for every config (default: vLLM's)")
    p.add_argument("--workload", choices=("cpu", "gpu"), default="cpu",
                   help="gpu: the GPU-shaped preset of the module docstring (sets the "
                        "lengths, pool, budget, configs and levels)")
    p.add_argument("--pool-blocks", type=int, default=None,
                   help="--num-gpu-blocks-override for every config (default: two full "
                        "requests of --max-model-len, plus vLLM's null block)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: input + output + one block")
    p.add_argument("--prompts-per-slot", type=int, default=1,
                   help="prompts sent per unit of concurrency at each level")
    p.add_argument("--min-prompts", type=int, default=2, help="fewest prompts per level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poll", type=float, default=0.2, help="seconds between /metrics polls")
    p.add_argument("--out", type=pathlib.Path, default=REPO / "runs" / "serving_capacity",
                   help="output directory (default: runs/serving_capacity)")
    p.add_argument("--update-docs", action="store_true",
                   help="write the section of docs/performance.md and docs/figures/serving/")
    p.add_argument("--smoke", action="store_true",
                   help="tiny lengths, concurrency 1,2, one baseline (script check); "
                        "implies --self-check")
    p.add_argument("--self-check", action="store_true",
                   help="evicting servers run with NEXUS_VLLM_SELF_CHECK=1 (the bounds "
                        "checked in vLLM's block pool, the worker's key views and scores)")
    p.add_argument("--from-json", type=pathlib.Path, default=None, metavar="CAPACITY_JSON",
                   help="run nothing: rewrite the table, plots (and with --update-docs the "
                        "docs section) from a capacity.json of an earlier run")
    args = p.parse_args(argv)
    if args.workload == "gpu":
        args.input_len, args.output_len, args.keep, args.chunk = 1024, 128, 0.25, 512
        args.pool_blocks, args.max_num_batched_tokens = 161, 1024
        args.concurrency, args.prompts_per_slot, args.min_prompts = "12", 1, 12
        args.configs = ("stock;nexus:prompt_mode=stream;nexus:prompt_mode=end;"
                        "nexus:prompt_mode=keep")
        if args.out == REPO / "runs" / "serving_capacity":
            args.out = REPO / "runs" / "serving_capacity_gpu"
    if args.smoke:
        args.input_len, args.output_len, args.chunk = 1024, 16, 64
        # Both prompt modes: end's bound is the longest prompt's own length (the tiny
        # tokenizer re-encodes some random prompts longer than --input-len), stream's is
        # budget + one chunk.
        args.concurrency = "1,2"
        args.configs = "stock;nexus;streaming:prompt_mode=stream"
        args.prompts_per_slot, args.min_prompts = 1, 2
        args.self_check = True
    names = split_configs(args.configs)
    evicting = {n: config_knobs(n) for n in names if n not in STOCK}
    methods = evicting_methods()
    unknown = {n for n, (method, _) in evicting.items() if method not in methods}
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; choose from "
                f"{', '.join([*STOCK, *methods])}")
    from nexus_vllm.core import EvictionConfig

    for name, (method, knobs) in evicting.items():
        try:
            EvictionConfig.from_dict({"method": method, **knobs})
        except ValueError as exc:
            p.error(f"--configs {name!r}: {exc}")
    if len(set(names)) != len(names):
        p.error("--configs: each config once")
    try:
        args.levels = sorted({int(c) for c in args.concurrency.split(",")})
    except ValueError:
        p.error(f"--concurrency: comma-separated integers, got {args.concurrency!r}")
    if not args.levels or args.levels[0] < 1:
        p.error("--concurrency: levels must be >= 1")
    if not 0.0 < args.keep <= 1.0:
        p.error("--keep: a fraction in (0, 1]")
    for name in ("input_len", "output_len", "chunk", "block_size", "prompts_per_slot",
                 "min_prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    args.names = names
    return args


def split_configs(text: str) -> list[str]:
    """``--configs``: comma-separated, or ``;``-separated when knobs (with commas) are used."""
    return [n.strip() for n in text.split(";" if ";" in text else ",")]


def config_knobs(name: str) -> tuple[str, dict[str, Any]]:
    """``"nexus:layer_stride=2"`` -> ``("nexus", {"layer_stride": 2})`` (the eval harness's
    method syntax)."""
    from nexus_vllm.eval.runner import parse_method

    try:
        spec = parse_method(name)
    except ValueError:
        return name, {}
    return spec.method, dict(spec.knobs)


def file_stem(name: str) -> str:
    """A config name made safe for a file name (knobs carry ``:``, ``=`` and ``,``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def derive(args: argparse.Namespace) -> dict[str, int]:
    """Budget, bounds and pool in blocks/tokens from the options (what the servers get)."""
    from nexus_vllm.core import EvictionConfig
    from nexus_vllm.sizing import stock_admission_blocks

    bs = args.block_size
    forced = EvictionConfig(block_size=bs).num_forced
    budget_blocks = max(math.ceil(args.keep * args.input_len / bs - 1e-9), forced)
    seq_tokens = args.input_len + args.output_len
    max_model_len = args.max_model_len or seq_tokens + bs
    if max_model_len < seq_tokens:
        raise SystemExit(f"--max-model-len {max_model_len} < input + output = {seq_tokens}")
    full_blocks = _cdiv(max_model_len, bs)
    # vLLM starts only if one request of max_model_len fits in the usable pool (all blocks
    # but the null block).
    pool = args.pool_blocks or 2 * full_blocks + 1
    if pool - 1 < full_blocks:
        raise SystemExit(f"--pool-blocks {pool}: vLLM needs at least {full_blocks + 1} "
                         f"(one --max-model-len {max_model_len} request plus the null block)")
    seq_blocks = _cdiv(seq_tokens, bs)
    # The default method's bound (the server's own rule) for a prompt of --input-len
    # tokens; each row's follows its config and the longest prompt it sent.
    bound = bound_blocks(EvictionConfig(block_size=bs, max_tokens=budget_blocks * bs,
                                        chunk_size=args.chunk), args.input_len, seq_tokens)
    return {
        "block_size": bs, "budget_tokens": budget_blocks * bs, "budget_blocks": budget_blocks,
        "chunk_tokens": args.chunk, "bound_blocks": bound, "seq_blocks": seq_blocks,
        "prompt_blocks": _cdiv(args.input_len, bs), "max_model_len": max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "pool_blocks": pool, "usable_blocks": pool - 1,
        # What admission alone allows: stock by whole prompts (vLLM 0.32 reserves the full
        # input at admission), evicting servers by their bound.
        "stock_fit": (pool - 1) // stock_admission_blocks(args.input_len, bs),
        "evicting_fit": (pool - 1) // bound,
        "bound_at": args.input_len,
    }


def config_bound(name: str, d: dict[str, int], args: argparse.Namespace,
                 prompt_tokens: int | None = None) -> int:
    """Most blocks one request of config ``name`` may hold: the server's own rule
    (``budget.bound_blocks``, which follows the config's ``prompt_mode``), so the
    benchmark cannot drift from what admission reserves. Stock: the whole sequence
    (the sizing rule, ``nexus_vllm.sizing``). ``prompt_tokens``: the longest prompt
    sent (default ``--input-len``; a prompt's own length sets the bound of ``end``)."""
    from nexus_vllm.core import EvictionConfig
    from nexus_vllm.sizing import stock_bound_blocks

    prompt = args.input_len if prompt_tokens is None else int(prompt_tokens)
    if name in STOCK:
        return stock_bound_blocks(prompt + args.output_len, d["block_size"])

    method, knobs = config_knobs(name)
    cfg = EvictionConfig.from_dict({"method": method, "max_tokens": d["budget_tokens"],
                                    "chunk_size": d["chunk_tokens"],
                                    "block_size": d["block_size"], **knobs})
    return bound_blocks(cfg, prompt, prompt + args.output_len)


def longest_prompt(res: dict[str, Any], input_len: int, special_tokens: int) -> int:
    """Tokens of the longest prompt the server got in a ``vllm bench serve`` result
    (saved with ``--save-detailed``): the random prompts are ``input_len`` tokens only as
    far as the tokenizer re-encodes them to that length (vLLM's benchmark gives up after
    some retries), plus what the server's tokenizer adds (a BOS)."""
    lens = [int(n) for n in res.get("input_lens") or ()]
    return (max(lens) if lens else input_len) + special_tokens


def added_special_tokens(model: str) -> int:
    """Tokens the model's tokenizer adds to a completion prompt (the benchmark counts a
    random prompt without them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return len(tok("x").input_ids) - len(tok("x", add_special_tokens=False).input_ids)


def server_flags(name: str, d: dict[str, int], max_seqs: int, gpu: bool) -> list[str]:
    base = (["--gpu-memory-utilization", "0.9"] if gpu else
            ["--enforce-eager", "--dtype", "float32", "--distributed-executor-backend", "uni"])
    flags = [*base, "--max-model-len", str(d["max_model_len"]), "--max-num-seqs", str(max_seqs),
             "--block-size", str(d["block_size"]), "--num-gpu-blocks-override",
             str(d["pool_blocks"]), "--no-enable-prefix-caching"]
    if d.get("max_num_batched_tokens"):
        flags += ["--max-num-batched-tokens", str(d["max_num_batched_tokens"])]
    if name in STOCK:
        flags += [f.format(chunk=d["chunk_tokens"]) for f in STOCK[name]]
    else:
        method, knobs = config_knobs(name)
        flags += ["--kv-eviction", method, "--kv-budget", str(d["budget_tokens"]),
                  "--kv-chunk-size", str(d["chunk_tokens"])]
        if knobs:
            flags += ["--additional-config", json.dumps({"nexus": knobs})]
    return flags


# -- measurement ------------------------------------------------------------------------
class Poller(threading.Thread):
    """Polls ``/metrics`` until stopped; keeps the maxima the table needs."""

    def __init__(self, server: Any, usable: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.server, self.usable, self.interval = server, usable, interval
        self.stop_event = threading.Event()
        self.samples = 0
        self.peak_running = 0.0
        self.peak_waiting = 0.0
        self.peak_pool = 0.0
        self.peak_per_request = 0.0
        self.peak_live_max = 0.0

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                m = self.server.metrics()
            except Exception:  # noqa: BLE001 - a missed poll is only a missed sample
                m = None
            if m:
                self.samples += 1
                running = m.get("vllm:num_requests_running", 0.0)
                total = m.get("vllm:nexus_total_blocks", self.usable) or self.usable
                used = m.get("vllm:kv_cache_usage_perc", 0.0) * total
                self.peak_running = max(self.peak_running, running)
                self.peak_waiting = max(self.peak_waiting,
                                        m.get("vllm:num_requests_waiting", 0.0))
                self.peak_pool = max(self.peak_pool, used)
                if running > 0:
                    self.peak_per_request = max(self.peak_per_request, used / running)
                self.peak_live_max = max(self.peak_live_max,
                                         m.get("vllm:nexus_live_blocks_max", 0.0))
            self.stop_event.wait(self.interval)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=30)


def _delta(after: Mapping[str, float], before: Mapping[str, float], key: str) -> float:
    """How much series ``key`` (summed over its labels) grew; an absent series is 0."""
    return after.get(key, 0.0) - before.get(key, 0.0)


def run_level(server: Any, name: str, level: int, args: argparse.Namespace,
              d: dict[str, int], result_dir: pathlib.Path) -> tuple[dict[str, Any], dict]:
    from nexus_vllm.eval.server import bench_serve

    num_prompts = max(level * args.prompts_per_slot, args.min_prompts)
    before = server.metrics()
    poller = Poller(server, d["usable_blocks"], args.poll)
    poller.start()
    t0 = time.monotonic()
    try:
        res = bench_serve(server, input_len=args.input_len, output_len=args.output_len,
                          num_prompts=num_prompts, concurrency=level, result_dir=result_dir,
                          label=f"bench-{file_stem(name)}-c{level}", seed=args.seed + level,
                          extra=["--save-detailed"], in_process=True)
    finally:
        time.sleep(max(2 * args.poll, 0.5))  # the last steps' stats reach /metrics
        poller.stop()
    wall = time.monotonic() - t0
    after = server.metrics()
    evicting = name not in STOCK
    step_s = _delta(after, before, "vllm:nexus_step_seconds_total")
    scoring_s = _delta(after, before, "vllm:nexus_scoring_seconds_total")
    policy_s = _delta(after, before, "vllm:nexus_policy_seconds_total")
    if evicting:
        peak_req = poller.peak_live_max
        peak_gauge = after.get("vllm:nexus_live_blocks_peak", 0.0)
        if peak_gauge > before.get("vllm:nexus_live_blocks_peak", 0.0):
            peak_req = max(peak_req, peak_gauge)  # the high-water mark rose in this level
    else:
        peak_req = poller.peak_per_request
    errors: Any = res.get("errors") or []
    prompt = longest_prompt(res, args.input_len, d["special_tokens"])
    row: dict[str, Any] = {
        "config": name, "concurrency": level, "num_prompts": num_prompts,
        "completed": int(res["completed"]), "failed": int(res["failed"]),
        "peak_running": int(poller.peak_running),
        "client_max_concurrent": res.get("max_concurrent_requests"),
        "peak_waiting": int(poller.peak_waiting),
        "preemptions": int(_delta(after, before, "vllm:num_preemptions_total")),
        "output_tok_s": float(res["output_throughput"]),
        "duration_s": float(res["duration"]),
        "ttft_p50_ms": float(res["median_ttft_ms"]), "ttft_p99_ms": float(res["p99_ttft_ms"]),
        "tpot_p50_ms": float(res["median_tpot_ms"]), "tpot_p99_ms": float(res["p99_tpot_ms"]),
        "peak_pool_blocks": round(poller.peak_pool, 1),
        "peak_pool_frac": round(poller.peak_pool / d["usable_blocks"], 4),
        "peak_blocks_per_request": round(peak_req, 1),
        "longest_prompt": prompt,
        "bound_blocks": config_bound(name, d, args, prompt),
        "overhead": (scoring_s + policy_s) / step_s if evicting and step_s > 0 else None,
        "scoring_s": round(scoring_s, 4), "policy_s": round(policy_s, 4),
        "step_s": round(step_s, 4),
        "evicted_blocks": int(_delta(after, before, "vllm:nexus_evicted_blocks_total")),
        "eviction_events": int(_delta(after, before, "vllm:nexus_eviction_events_total")),
        "admission_waits": int(_delta(after, before, "vllm:nexus_admission_waits_total")),
        "faults": int(_delta(after, before, FAULTS)),
        "live_blocks_peak_lifetime": after.get("vllm:nexus_live_blocks_peak"),
        "over_budget_peak_lifetime": after.get("vllm:nexus_live_blocks_over_budget"),
        # The self-check's (--self-check, where the server exports it): the most blocks
        # one request held in vLLM's own block lists, and the most above its bound.
        "pool_blocks_peak_lifetime": after.get("vllm:nexus_pool_blocks_peak"),
        "pool_over_bound_lifetime": after.get("vllm:nexus_pool_over_bound"),
        "mean_input_len": (res["total_input_tokens"] / res["completed"]
                           if res.get("completed") else None),
        "errors": sorted({str(e) for e in errors if e})[:5],
        "polls": poller.samples, "wall_s": round(wall, 1),
        "load1": round(os.getloadavg()[0], 1),
    }
    return row, res


def _log_problems(path: pathlib.Path) -> dict[str, Any]:
    """Counts of alarming lines in a server log (tracebacks, errors, nexus warnings)
    before its shutdown began (vLLM logs an ``EngineDeadError`` when it is stopped)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    stop = next((i for i, ln in enumerate(lines) if "[shutdown]" in ln), len(lines))
    lines = lines[:stop]
    pick = {
        "tracebacks": [ln for ln in lines if ln.startswith("Traceback")],
        "errors": [ln for ln in lines if " ERROR " in ln or ln.startswith("ERROR")],
        "nexus_warnings": [ln for ln in lines if "nexus-vllm" in ln and "WARNING" in ln],
        "preemption_lines": [ln for ln in lines if "preempt" in ln.lower()],
    }
    return {k: {"count": len(v), "first": v[:3]} for k, v in pick.items()}



def machine() -> str:
    import torch

    try:
        import vllm

        vv = vllm.__version__
    except Exception:  # noqa: BLE001
        vv = "?"
    if torch.cuda.is_available():
        dev = torch.cuda.get_device_name()
    else:
        cpu = platform.processor() or platform.machine()
        try:
            for ln in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        dev = f"CPU: {cpu}, {os.cpu_count()} cores"
    return f"{dev}; torch {torch.__version__}, vLLM {vv}"


def command_line(argv: list[str]) -> str:
    script = pathlib.Path(__file__).resolve()
    try:
        script_s = str(script.relative_to(pathlib.Path.cwd()))
    except ValueError:
        script_s = str(script.relative_to(REPO)) if script.is_relative_to(REPO) else str(script)
    return shlex.join(["python", script_s, *argv])


# -- main -------------------------------------------------------------------------------
def _report_module() -> Any:
    """``capacity_report.py`` next to this file, loaded by path (the benchmarks are
    scripts, not a package; the report never imports this module)."""
    import importlib.util

    path = pathlib.Path(__file__).with_name("capacity_report.py")
    spec = importlib.util.spec_from_file_location("capacity_report", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(capacity_json: pathlib.Path, update_docs: bool) -> None:
    """The docs side on a saved run: ``capacity.md`` and plots next to ``capacity_json``
    (and with ``update_docs`` the docs section)."""
    module = _report_module()
    print("\n" + module.report(json.loads(capacity_json.read_text()), capacity_json.parent,
                               update_docs))
    if update_docs:
        print(f"updated {module.DOCS} and {module.FIGURES}")


def measure(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Run every config at every level; return what ``capacity.json`` holds (one row per
    config and level that ran, the settings, the derived sizes, each server's flags)."""
    import torch
    from tqdm import tqdm

    from nexus_vllm.eval.server import VllmServer

    t_start = time.monotonic()
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    gpu = torch.cuda.is_available()
    model = args.model
    if model is None:
        from nexus_vllm.models import default_model_path

        model = str(default_model_path())
    d = derive(args)
    d["special_tokens"] = added_special_tokens(model)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs").mkdir(exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    max_seqs = max(args.levels)
    print(f"capacity: budget {d['budget_tokens']} tokens ({d['budget_blocks']} blocks), "
          f"bound {d['bound_blocks']} blocks at {args.input_len} prompt tokens (each row's: "
          f"at its longest prompt), stock request {d['seq_blocks']} blocks, pool "
          f"{d['usable_blocks']} usable blocks -> admission fits stock {d['stock_fit']}, "
          f"evicting {d['evicting_fit']}; out {out}", flush=True)
    rows: list[dict[str, Any]] = []
    servers: dict[str, Any] = {}
    bar = tqdm(total=len(args.names) * len(args.levels), desc="capacity", unit="run")
    for name in args.names:
        bar.set_postfix_str(f"{name}: starting")
        t0 = time.monotonic()
        env = ({"NEXUS_VLLM_SELF_CHECK": "1"} if args.self_check and name not in STOCK
               else None)
        try:
            server = VllmServer(model, server_flags(name, d, max_seqs, gpu), logs,
                                base_flags=[], startup_timeout=900, env=env)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next config
            servers[name] = {"error": str(exc)[-2000:]}
            tqdm.write(f"{name}: server failed to start: {str(exc)[-500:]}")
            bar.update(len(args.levels))
            continue
        servers[name] = {"startup_s": round(time.monotonic() - t0, 1),
                         "log": str(server.log_path), "flags": server_flags(name, d, max_seqs,
                                                                              gpu)}
        try:
            for level in args.levels:
                bar.set_postfix_str(f"{name} c={level}")
                try:
                    row, res = run_level(server, name, level, args, d, out / "bench")
                except Exception as exc:  # noqa: BLE001
                    tqdm.write(f"{name} c={level}: {str(exc)[-800:]}")
                    servers[name].setdefault("level_errors", {})[level] = str(exc)[-2000:]
                    bar.update(1)
                    continue
                rows.append(row)
                (out / "runs" / f"{file_stem(name)}-c{level}.json").write_text(
                    json.dumps({"row": row, "bench": res}, indent=2))
                tqdm.write(f"{name:>9} c={level:<3} running {row['peak_running']:>2} "
                           f"preempt {row['preemptions']:>3} out {row['output_tok_s']:7.1f} "
                           f"tok/s TTFT p50 {row['ttft_p50_ms']:7.0f} ms pool "
                           f"{row['peak_pool_blocks']:5.0f} per-req "
                           f"{row['peak_blocks_per_request']:5.1f} overhead "
                           + ("-" if row["overhead"] is None
                              else f"{100 * row['overhead']:.1f}%"))
                bar.update(1)
        finally:
            server.stop()
            servers[name]["log_problems"] = _log_problems(server.log_path)
    bar.close()
    return {
        "command": command_line(argv), "machine": machine(), "gpu": gpu, "model": model,
        "settings": {k: v for k, v in vars(args).items()
                     if k not in ("out", "names", "levels", "from_json")} | {"out": str(out)},
        "derived": d, "servers": servers, "rows": rows,
        "load_before": load_before,
        "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "wall_s": round(time.monotonic() - t_start, 1),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.from_json is not None:
        report(args.from_json, args.update_docs)
        return 0
    result = measure(args, argv)
    capacity_json = args.out / "capacity.json"
    capacity_json.write_text(json.dumps(result, indent=2, default=str))
    report(capacity_json, args.update_docs)
    print(f"wall time {result['wall_s'] / 60:.1f} min; results in {args.out}")
    expected = len(args.names) * len(args.levels)
    failed = sum(r["failed"] for r in result["rows"])
    return 0 if len(result["rows"]) == expected and failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
