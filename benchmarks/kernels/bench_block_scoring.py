"""Microbenchmark: paged block scoring and block-table compaction (Triton vs torch reference).

GPU run (the real measurement)::

    python benchmarks/kernels/bench_block_scoring.py [--json results.json]

sweeps contexts 4k-128k, windows W = 16/32 and Llama-3-8B (32 q / 8 kv heads, D = 128) and
Llama-3-70B (64 q / 8 kv heads) head shapes, timing each launch with
``triton.testing.do_bench`` (median). For each point it prints the achieved bandwidth
(minimum bytes the op must move: the live keys, the queries and the float32 output,
divided by the time), the fraction of the device's peak HBM bandwidth (from
``--peak-gbps`` or a table keyed on the device name), and the speed ratio against the torch
reference (``backend="torch"``: ``nexus_vllm.core`` per request) timed in the same run.
``--attention-reduce max`` times the maximum over query heads (the combine launch's ``HEAD_MAX``
build) instead of their mean; the bytes moved are the same. It then times
``compact_block_tables`` against a decode-step proxy (the time to read a model's bf16
weights once at this device's measured copy bandwidth).

``--smoke`` runs tiny shapes under the Triton CPU interpreter (no GPU needed) to exercise the
whole script; its timings say nothing about GPU speed. Without a GPU and without
``--smoke`` the script prints why it cannot measure and exits with status 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

# Peak HBM bandwidth in GB/s by device-name substring (vendor datasheets; first match wins).
PEAK_GBPS = {
    "H200": 4800.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "H20": 4000.0,
    "GH200": 4000.0,
    "B200": 8000.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "L40": 864.0,
    "L4": 300.0,
    "A10G": 600.0,
    "A10": 600.0,
    "RTX 4090": 1008.0,
}

# name: (query heads, kv heads, head size, bf16 weight bytes for the decode proxy)
MODELS = {
    "llama-8b": (32, 8, 128, 16.06e9),
    "llama-70b": (64, 8, 128, 141.1e9),
}


@dataclass(frozen=True)
class ScoringPoint:
    model: str
    context: int
    window: int
    batch: int
    block_size: int
    dtype: str
    attention_reduce: str
    triton_us: float
    torch_us: float | None
    gbps: float
    peak_fraction: float | None
    speedup: float | None
    max_abs_diff: float | None


@dataclass(frozen=True)
class CompactionPoint:
    requests: int
    max_blocks: int
    compact_us: float
    decode_proxy_us: float
    fraction_of_decode: float


def peak_gbps_for(name: str) -> float | None:
    for key, value in PEAK_GBPS.items():
        if key.lower() in name.lower():
            return value
    return None


def _parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _timer(smoke: bool) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds per call: do_bench on GPU, a few wall-clock runs in smoke mode."""
    if not smoke:
        import triton.testing

        def bench(fn: Callable[[], object]) -> float:
            return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

        return bench

    def wall(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[1]

    return wall


def _make_inputs(torch, r, w, hq, hkv, d, context, block_size, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    n = -(-context // block_size)
    num_blocks = r * n + 1
    key_cache = torch.randn(
        (num_blocks, block_size, hkv, d), generator=gen, device=device, dtype=dtype
    )
    queries = torch.randn((r, w, hq, d), generator=gen, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
    block_tables = perm[: r * n].view(r, n).to(torch.int32)
    seq_lens = torch.full((r,), context, dtype=torch.int32, device=device)
    return queries, key_cache, block_tables, seq_lens


def bench_scoring(args, torch, kernels, bench, device, peak) -> list[ScoringPoint]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    points = []
    for model in args.models:
        hq, hkv, d, _ = MODELS[model] if not args.smoke else (4, 2, 32, 0)
        for w in args.windows:
            for ctx in args.contexts:
                q, kc, bt, sl = _make_inputs(
                    torch, args.batch, w, hq, hkv, d, ctx, args.block_size, dtype, device
                )
                out = torch.zeros(bt.shape[0], w, bt.shape[1], device=device)

                hr = args.attention_reduce

                def run_triton(q=q, kc=kc, bt=bt, sl=sl, out=out, hr=hr):
                    return kernels.block_attention_mass_paged(
                        q, kc, bt, sl, backend="triton", out=out, attention_reduce=hr
                    )

                def run_torch(q=q, kc=kc, bt=bt, sl=sl, hr=hr):
                    return kernels.block_attention_mass_paged(
                        q, kc, bt, sl, backend="torch", attention_reduce=hr
                    )

                got = kernels.block_attention_mass_paged(
                    q, kc, bt, sl, backend="triton", attention_reduce=hr
                )
                t_ms = bench(run_triton)
                torch_ms = diff = None
                if ctx <= args.torch_max_context:
                    want = run_torch()
                    diff = float((got - want).abs().max())
                    torch_ms = bench(run_torch)
                elt = q.element_size()
                n_bytes = (
                    args.batch * ctx * hkv * d * elt  # live keys, read once
                    + q.numel() * elt
                    + out.numel() * 4 * 2  # float32 output, read and written (accumulate)
                )
                gbps = n_bytes / (t_ms * 1e-3) / 1e9
                point = ScoringPoint(
                    model=model,
                    context=ctx,
                    window=w,
                    batch=args.batch,
                    block_size=args.block_size,
                    dtype=args.dtype,
                    attention_reduce=hr,
                    triton_us=t_ms * 1e3,
                    torch_us=None if torch_ms is None else torch_ms * 1e3,
                    gbps=gbps,
                    peak_fraction=None if peak is None else gbps / peak,
                    speedup=None if torch_ms is None else torch_ms / t_ms,
                    max_abs_diff=diff,
                )
                points.append(point)
                _print_scoring(point)
                del q, kc, bt, sl, out
    return points


def _print_scoring(p: ScoringPoint) -> None:
    frac = "n/a" if p.peak_fraction is None else f"{100 * p.peak_fraction:5.1f}%"
    torch_us = "skipped" if p.torch_us is None else f"{p.torch_us:10.1f}"
    speed = "n/a" if p.speedup is None else f"{p.speedup:7.1f}x"
    diff = "n/a" if p.max_abs_diff is None else f"{p.max_abs_diff:.1e}"
    print(
        f"{p.model:>10} W={p.window:<3} ctx={p.context:<7} triton {p.triton_us:10.1f} us "
        f"{p.gbps:8.1f} GB/s ({frac} of peak)  torch {torch_us} us  speedup {speed}  "
        f"max|diff| {diff}",
        flush=True,
    )


def bench_compaction(args, torch, kernels, bench, device, copy_gbps) -> list[CompactionPoint]:
    points = []
    cases = [(8, 64)] if args.smoke else [(64, 2048), (256, 2048), (256, 8192)]
    weights = MODELS["llama-8b"][3]
    decode_us = weights / (copy_gbps * 1e9) * 1e6
    for r, m in cases:
        gen = torch.Generator(device=device).manual_seed(1)
        bt = torch.randint(1, 1 << 20, (r, m), generator=gen, device=device, dtype=torch.int32)
        bt = torch.where(torch.rand(r, m, generator=gen, device=device) < 0.3, 0, bt).int()
        sl = torch.full((r,), m * args.block_size, dtype=torch.int32, device=device)
        out_t = torch.empty_like(bt)
        out_s = torch.empty_like(sl)

        def run(bt=bt, sl=sl, out_t=out_t, out_s=out_s):
            return kernels.compact_block_tables(
                bt, sl, args.block_size, out_tables=out_t, out_seq_lens=out_s, backend="triton"
            )

        t_us = bench(run) * 1e3
        p = CompactionPoint(r, m, t_us, decode_us, t_us / decode_us)
        points.append(p)
        print(
            f"compaction R={r:<4} max_blocks={m:<5} {t_us:8.1f} us = "
            f"{100 * p.fraction_of_decode:.3f}% of a Llama-8B decode-step proxy "
            f"({decode_us:.0f} us)",
            flush=True,
        )
    return points


def _copy_gbps(torch, device, smoke: bool, bench) -> float:
    """Measured device-to-device copy bandwidth (read + write), GB/s."""
    n = (1 << 16) if smoke else (1 << 28)
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--contexts", type=_parse_ints, default=[4096, 8192, 16384, 32768, 65536, 131072]
    )
    ap.add_argument("--windows", type=_parse_ints, default=[16, 32])
    ap.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument(
        "--attention-reduce",
        choices=("mean", "max"),
        default="mean",
        help="how the query heads combine (the kernels' attention_reduce)",
    )
    ap.add_argument("--peak-gbps", type=float, default=None, help="override the peak table")
    ap.add_argument(
        "--torch-max-context",
        type=int,
        default=131072,
        help="skip the torch reference above this context (it materialises [Hq, W, T] fp32)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    ap.add_argument("--json", default=None, help="write all points to this file")
    args = ap.parse_args(argv)
    for m in args.models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {sorted(MODELS)}")

    if args.smoke:
        args.contexts = [100, 300]
        args.windows = [4]
        args.models = ["llama-8b"]
        args.dtype = "fp32" if args.dtype == "fp32" else "bf16"
    try:
        import torch
    except ImportError:
        print("bench_block_scoring: torch is not installed; nothing to measure.")
        return 0
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print(
            "bench_block_scoring: no CUDA GPU on this machine, so nothing can be measured. "
            "Run it on a GPU (scripts/device_check.sh), or pass --smoke to exercise the "
            "script on tiny shapes under the Triton CPU interpreter."
        )
        return 0
    if not cuda:
        # Must be set before the kernel module is decorated (it is imported lazily).
        os.environ["TRITON_INTERPRET"] = "1"
    from nexus_vllm import kernels

    if not kernels.HAS_TRITON:
        print("bench_block_scoring: triton is not installed (pip install 'nexus-vllm[triton]').")
        return 0
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(device) if cuda else "CPU (Triton interpreter)"
    peak = args.peak_gbps if args.peak_gbps is not None else (peak_gbps_for(name) if cuda else None)
    bench = _timer(smoke=not cuda)
    print(
        f"device: {name}; peak HBM: {'unknown' if peak is None else f'{peak:.0f} GB/s'}; "
        f"dtype {args.dtype}; block size {args.block_size}; batch {args.batch}; "
        f"attention_reduce {args.attention_reduce}",
        flush=True,
    )
    if not cuda:
        print("SMOKE MODE: interpreter timings are not GPU performance.")
    copy_gbps = _copy_gbps(torch, device, not cuda, bench)
    print(f"measured copy bandwidth: {copy_gbps:.1f} GB/s", flush=True)
    scoring = bench_scoring(args, torch, kernels, bench, device, peak)
    compaction = bench_compaction(args, torch, kernels, bench, device, copy_gbps)
    bad = [p for p in scoring if p.max_abs_diff is not None and not p.max_abs_diff <= 1e-3]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": name,
                    "peak_gbps": peak,
                    "copy_gbps": copy_gbps,
                    "smoke": not cuda,
                    "scoring": [asdict(p) for p in scoring],
                    "compaction": [asdict(p) for p in compaction],
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    if bad:
        print(f"MISMATCH: {len(bad)} points differ from the torch reference by > 1e-3")
        return 1
    if any(not math.isfinite(p.gbps) for p in scoring):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
