"""The sizing table of docs/deploy.md, computed by ``nexus-vllm size`` (not measured).

For Llama-3.1-8B, Llama-3.1-70B and Qwen2.5-72B on one H200 node (8 GPUs x 141 GiB) and
on two, at 32k and 128k context and 10% / 20% keep-ratio budgets, per prompt mode
(``stream`` and ``end``, the default), every other flag at its ``nexus-vllm size``
default (no per-step token budget: the pool binds, not the prefill throughput). 8B runs one replica per GPU (tp=1); 70B/72B one replica of tp=8 on a node, tp=8
pp=2 on two. Prints the Markdown
table; ``--update-docs`` writes it between ``<!-- sizing-table:begin -->`` and
``<!-- sizing-table:end -->`` in docs/deploy.md.

    python scripts/sizing_table.py [--update-docs]
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import sys

from nexus_vllm.sizing import Sizing, build_parser, sizing_from_args

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "deploy.md"
BEGIN, END = "<!-- sizing-table:begin -->", "<!-- sizing-table:end -->"
GPU_GIB = 141
GPUS_PER_NODE = 8
# model -> per node count: (tp, pp)
LAYOUTS = {
    "llama-3.1-8b": {1: (1, 1), 2: (1, 1)},
    "llama-3.1-70b": {1: (8, 1), 2: (8, 2)},
    "qwen2.5-72b": {1: (8, 1), 2: (8, 2)},
}
CONTEXTS = (32768, 131072)
BUDGETS = ("0.1", "0.2")
MODES = ("stream", "end")


def size(argv: list[str]) -> Sizing:
    parser = build_parser()
    return sizing_from_args(parser.parse_args(argv), parser)


def rows() -> list[str]:
    mode_cols = "".join(f"| {m} | {m} ratio " for m in MODES)
    lines = ["| model | nodes | layout | context | budget | KV blocks / GPU | prompt + output "
             f"| stock requests {mode_cols}|", "|" + "---|" * (8 + 2 * len(MODES))]
    for model, layouts in LAYOUTS.items():
        for nodes, (tp, pp) in layouts.items():
            replicas = nodes * GPUS_PER_NODE // (tp * pp)
            layout = f"{replicas} x tp={tp}" + (f" pp={pp}" if pp > 1 else "")
            for context in CONTEXTS:
                for budget in BUDGETS:
                    cells = []
                    for mode in MODES:
                        argv = ["--model", model, "--gpu-memory-gib", str(GPU_GIB), "--tp",
                                str(tp), "--pp", str(pp), "--context", str(context),
                                "--budget", budget, "--prompt-mode", mode]
                        p = size(argv)
                        stock = p.stock["concurrent"] * replicas
                        evict = p.evicting["concurrent"] * replicas
                        ratio = f"{evict / stock:.1f}x" if stock else "-"
                        cells.append(f"{evict:,} | {ratio}")
                        print(f"  nexus-vllm size {shlex.join(argv)}", file=sys.stderr)
                    lines.append(
                        f"| {model} | {nodes} | {layout} | {context // 1024}k "
                        f"| {float(budget):.0%} | {p.pool_blocks:,} "
                        f"| {p.prompt_tokens:,} + {p.output_tokens:,} | {stock:,} | "
                        + " | ".join(cells) + " |")
    return lines


def section() -> str:
    return "\n".join([BEGIN, "", "*Computed by `nexus-vllm size`, not measured* "
                      "(`python scripts/sizing_table.py --update-docs` rewrites this table).",
                      "", *rows(), "", END])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--update-docs", action="store_true",
                   help=f"write the table into {DOCS.relative_to(REPO)}")
    args = p.parse_args(argv)
    text = section()
    if not args.update_docs:
        print(text)
        return 0
    doc = DOCS.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOCS}: no {BEGIN} ... {END} markers")
    pre, rest = doc.split(BEGIN, 1)
    DOCS.write_text(pre + text + rest.split(END, 1)[1])
    print(f"updated {DOCS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
