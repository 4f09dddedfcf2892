"""``nexus-vllm compare``: one method against others on the same samples, paired.

    nexus-vllm compare runs/headline/records.jsonl --a nexus --b snapkv --b tova \
        --where protocol=question-last --where budget=0.2

Prints, per baseline and metric, whether ``--a`` is better, worse or not distinguishable
(paired bootstrap interval of the mean difference, exact sign test on per-sample wins);
``--json`` also writes the comparisons.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

from nexus_vllm.eval.records import load_selected
from nexus_vllm.eval.stats import METRICS, paired_comparison


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nexus-vllm compare",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+", type=pathlib.Path, help="records.jsonl files")
    p.add_argument("--a", required=True, metavar="METHOD", help="the method under test")
    p.add_argument("--b", action="append", required=True, metavar="METHOD",
                   help="a baseline; repeatable")
    p.add_argument("--metric", action="append", choices=METRICS, default=None,
                   help="repeatable (default: score, delta_loglik, kl)")
    p.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE",
                   help="keep records whose FIELD equals VALUE; repeatable, all must hold")
    p.add_argument("--task", action="append", default=[], metavar="TASK",
                   help="keep only these tasks (repeatable; default: all)")
    p.add_argument("--json", type=pathlib.Path, default=None, help="also write them here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    records = load_selected(p, args.sources, args.where)
    metrics = args.metric or ["score", "delta_loglik", "kl"]
    try:
        if args.task:
            records = [r for r in records if r.task in args.task]
        found = [paired_comparison(records, args.a, b, metric=m)
                 for b in args.b for m in metrics]
    except ValueError as exc:
        p.error(str(exc))
    for c in found:
        print(c.line())
    if args.json is not None:
        args.json.write_text(json.dumps([dataclasses.asdict(c) for c in found], indent=1) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
