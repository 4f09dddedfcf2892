"""What each evidence kind costs the worker per eviction event on the CPU, side by side,
at SmolLM2-135M shapes: every registered kind's worker gatherer
(``EvidenceKind.gather_paged``) on the same batch, and the ratio of each to the mass.

    python benchmarks/kernels/evidence_cost.py [--threads 1] [--repeats 5] [--kinds a,b]

One event gathers every request due over its live blocks in 28 of SmolLM2's 30 layers
(9 query heads, 3 KV heads, head size 64; 32-token blocks). Prints the best of
``--repeats`` wall times per event per kind, and each kind's time over the mass's.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from nexus_vllm.core import EVIDENCE_KINDS, Rotary, evidence_kind
from nexus_vllm.core.evidence import PagedBatch
from nexus_vllm.kernels import block_attention_mass_paged_layers

LAYERS, HQ, HKV, D, BS = 28, 9, 3, 64, 32
# (requests due, live blocks each, window rows): a prefill event of one request at the
# stream default's budget + chunk, a few at once, decode events of a batch.
CASES = [(1, 32, 32), (4, 32, 32), (8, 20, 16)]


def make_batch(requests: int, blocks: int, rows: int, seed: int = 0) -> PagedBatch:
    g = torch.Generator().manual_seed(seed)
    num_blocks = requests * blocks + 1
    caches = [torch.randn(num_blocks, HKV, BS, D, generator=g) for _ in range(LAYERS)]
    tables = torch.randperm(num_blocks, generator=g)[:requests * blocks].view(
        requests, blocks).to(torch.int32)
    lens = torch.full((requests,), blocks * BS, dtype=torch.int32)
    ends = lens.long()
    inv_freq = 1.0 / (100000 ** (torch.arange(0, D, 2).float() / D))
    return PagedBatch(
        queries=torch.randn(LAYERS, requests, rows, HQ, D, generator=g),
        rows=torch.full((requests,), rows), query_positions=ends[:, None] - rows
        + torch.arange(rows)[None, :], next_positions=ends, key_caches=caches, tables=tables,
        seq_lens=lens, attention_reduce="max", layers_divisor=LAYERS,
        paged_mass=functools.partial(block_attention_mass_paged_layers, backend="batched"),
        rotary=Rotary.from_inv_freq(inv_freq, 8192, head_size=D))


def time_kind(name: str, batch: PagedBatch, repeats: int) -> float:
    kind = evidence_kind(name)
    r, w = int(batch.queries.shape[1]), int(batch.queries.shape[2])
    n = int(batch.tables.shape[1])
    shape = (r, w, n) if kind.layout == "rows" else (r, n)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        out = torch.zeros(shape)
        t0 = time.perf_counter()
        kind.gather_paged(batch, out)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kinds", default=",".join(EVIDENCE_KINDS),
                    help="comma-separated evidence kinds (default: every registered one)")
    ap.add_argument("--cases", default=None,
                    help=f"requests:blocks:rows;... (default: {CASES})")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for k in kinds:
        evidence_kind(k)  # a clear error naming the known kinds
    cases = CASES if args.cases is None else [
        tuple(int(x) for x in c.split(":")) for c in args.cases.split(";")]
    names = ["mass", *(k for k in kinds if k != "mass")]
    print(f"{'requests x blocks x rows':>26} " + " ".join(f"{k:>20}" for k in names))
    for requests, blocks, rows in cases:
        batch = make_batch(requests, blocks, rows)
        times = {k: time_kind(k, batch, args.repeats) for k in names}
        cells = [f"{times[k] * 1e3:8.1f} ms ({times[k] / times['mass']:4.2f}x)" for k in names]
        print(f"{f'{requests} x {blocks} x {rows}':>26} " + " ".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
