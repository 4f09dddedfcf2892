"""What eviction's CUDA-graph mode, scheduling and hooks cost in decode throughput, side
by side.

Evicting servers run PIECEWISE CUDA graphs (attention eager, so the query hook runs on
every step) where stock vLLM replays FULL graphs for decode batches. They keep vLLM's
scheduling: async scheduling (vLLM's default on GPU) overlaps scheduling with the forward
pass, with two steps in flight. This starts, one after another on the same
model and GPU:

=====================  ===============================================================
config                 what it isolates
=====================  ===============================================================
``stock``              vLLM's default (FULL_AND_PIECEWISE graphs, async scheduling)
``stock-sync``         the same with ``--no-async-scheduling``: what synchronous
                       scheduling alone costs
``stock-piecewise``    PIECEWISE graphs and vLLM's default scheduling, as evicting
                       servers run: the graph-mode cost on top of ``stock``
``nexus-idle``         eviction on, budget = the max length: hooks without events
``nexus``              eviction on at ``--budget`` tokens: hooks, scoring and events
``nexus-sync``         the same with ``--no-async-scheduling``: what async scheduling
                       gains with eviction (a request whose event is in flight skips a
                       step)
=====================  ===============================================================

and drives each with ``vllm bench serve`` (random prompts of ``--input-len`` tokens,
``--output-len`` tokens each, EOS ignored) at each ``--concurrency``. It prints output
tokens/s and median TPOT with each config's ratio to ``stock`` measured in the same run,
and writes them to ``--out`` (JSON).

    python benchmarks/serving/cudagraph_cost.py --model MODEL [--out cg_cost.json]

On a machine without CUDA it runs the same flow on the CPU (no CUDA graphs there, so only
the hook cost is visible): ``--smoke`` uses tiny lengths for a quick check of the script.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

CONFIGS: dict[str, list[str]] = {
    "stock": [],
    "stock-sync": ["--no-async-scheduling"],
    "stock-piecewise": ["-cc", '{{"cudagraph_mode": "PIECEWISE"}}'],  # str.format escapes
    "nexus-idle": ["--kv-eviction", "nexus", "--kv-budget", "{max_len}"],
    "nexus": ["--kv-eviction", "nexus", "--kv-budget", "{budget}"],
    "nexus-sync": ["--kv-eviction", "nexus", "--kv-budget", "{budget}",
                   "--no-async-scheduling"],
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="HF model name or path (default: the embedded SmolLM2 checkpoint)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--prompts-per-slot", type=int, default=4,
                   help="prompts sent per unit of concurrency")
    p.add_argument("--budget", type=int, default=256, help="tokens, for the 'nexus' config")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny lengths (script check)")
    args = p.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    if args.smoke:
        args.input_len, args.output_len, args.prompts_per_slot = 64, 16, 1
        args.concurrency = "2"
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch
    from tqdm import tqdm

    from nexus_vllm.eval.server import CPU_FLAGS, VllmServer, bench_serve

    gpu = torch.cuda.is_available()
    model = args.model
    if model is None:
        from nexus_vllm.models import default_model_path

        model = str(default_model_path())
    max_len = args.input_len + args.output_len + 64
    base = (["--gpu-memory-utilization", "0.5"] if gpu else list(CPU_FLAGS))
    base += ["--max-model-len", str(max_len)]  # the last flag wins over CPU_FLAGS
    levels = [int(c) for c in args.concurrency.split(",")]
    names = args.configs.split(",")
    rows: list[dict[str, object]] = []
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="nexus_cg_cost_"))
    bar = tqdm(total=len(names) * len(levels), desc="cudagraph cost", unit="run")
    for name in names:
        flags = [f.format(budget=args.budget, max_len=max_len) for f in CONFIGS[name]]
        if not gpu and name == "stock-piecewise":
            bar.update(len(levels))
            continue  # no CUDA graphs on the CPU
        t0 = time.monotonic()
        server = VllmServer(model, ["--block-size", str(args.block_size), *flags], tmp,
                            base_flags=base, startup_timeout=900)
        try:
            for level in levels:
                res = bench_serve(server, input_len=args.input_len,
                                  output_len=args.output_len,
                                  num_prompts=level * args.prompts_per_slot, concurrency=level,
                                  result_dir=tmp / "results", label=f"{name}-{level}")
                m = server.metrics()
                rows.append({
                    "config": name, "concurrency": level,
                    "output_tok_s": res["output_throughput"],
                    "median_tpot_ms": res["median_tpot_ms"],
                    "p99_tpot_ms": res["p99_tpot_ms"],
                    "failed": res["failed"],
                    "evicted_blocks": m.get("vllm:nexus_evicted_blocks_total", 0.0),
                    "startup_s": round(time.monotonic() - t0, 1),
                })
                bar.update(1)
        finally:
            server.stop()
    bar.close()
    stock = {r["concurrency"]: r for r in rows if r["config"] == "stock"}
    print(f"\n{'config':<16} {'conc':>4} {'out tok/s':>10} {'vs stock':>8} "
          f"{'TPOT p50 ms':>11} {'vs stock':>8}")
    for r in rows:
        ref = stock.get(r["concurrency"])
        tps = float(r["output_tok_s"])  # type: ignore[arg-type]
        tpot = float(r["median_tpot_ms"])  # type: ignore[arg-type]
        ratio = f"{tps / float(ref['output_tok_s']):.3f}" if ref else "-"  # type: ignore[arg-type]
        ratio_t = f"{tpot / float(ref['median_tpot_ms']):.3f}" if ref else "-"  # type: ignore[arg-type]
        print(f"{r['config']:<16} {r['concurrency']:>4} {tps:>10.1f} {ratio:>8} "
              f"{tpot:>11.2f} {ratio_t:>8}")
    result = {"model": model, "device": torch.cuda.get_device_name() if gpu else "cpu",
              "input_len": args.input_len, "output_len": args.output_len,
              "budget": args.budget, "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    failed = sum(int(r["failed"]) for r in rows)  # type: ignore[call-overload]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
