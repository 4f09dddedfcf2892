"""``nexus-vllm sweep``: budget sweeps side by side, one family of samples each.

    nexus-vllm sweep chat=runs/stream_sweep_chat/records.jsonl \
        "long documents=runs/stream_sweep_longdoc/records.jsonl" --share 0.9 \
        --plot docs/figures/stream_sweeps/plot_score.png --json docs/figures/stream_sweeps/sweeps.json

For every family and method it prints the pooled score at each budget, the budget as the
mean kept fraction of the samples' prompts (a token budget over each sample's
``prompt_tokens``, so families with ratio and token budgets share one axis), and the
smallest budget whose score is at least ``--share`` of dense's; ``--plot`` draws one panel
per family. A family may be several record files (``NAME=A.jsonl,B.jsonl``), e.g. ours
and a peer's (a record in several counts once); ``--method`` keeps only some methods.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nexus_vllm.eval.records import Record, read_records
from nexus_vllm.eval.report import tasks_dense_solves
from nexus_vllm.eval.stats import bootstrap_ci

if TYPE_CHECKING:
    from matplotlib.artist import Artist

__all__ = ["SweepPoint", "main", "plot_sweeps", "smallest_reaching", "sweep_points"]


@dataclass(frozen=True)
class SweepPoint:
    """One method at one budget on one family: its pooled score and where it sits.

    ``budget`` is as the records give it (a keep ratio or a token count; None for dense);
    ``fraction`` is the mean over samples of the kept share of the prompt (1.0 for dense);
    ``score`` pools, per sample, the tasks dense solves (mean over seeds first), with its
    95% bootstrap interval ``lo``/``hi`` over the ``n`` samples; ``dense`` is dense's
    pooled score on the same tasks.
    """

    family: str
    method: str
    budget: float | int | None
    fraction: float
    score: float
    lo: float
    hi: float
    n: int
    dense: float


def _kept_fraction(r: Record) -> float:
    if r.budget is None:
        return 1.0
    if isinstance(r.budget, float):
        return r.budget
    return min(1.0, r.budget / r.prompt_tokens) if r.prompt_tokens else 1.0


def sweep_points(family: str, records: Sequence[Record], *,
                 min_dense_score: float = 0.5) -> list[SweepPoint]:
    """Every (method, budget) of ``records`` as a :class:`SweepPoint`.

    The score pools only tasks whose dense mean is at least ``min_dense_score``, as the
    reports' summaries do (a task dense cannot do says nothing about eviction).

    Raises
    ------
    ValueError
        Naming ``family`` when it has no dense records or no task dense solves.
    """
    if not any(r.method == "dense" for r in records):
        raise ValueError(f"family {family!r} has no dense records: the share of dense's "
                         "score needs them")
    solvable = tasks_dense_solves(records, min_dense_score)
    if not solvable:
        raise ValueError(f"family {family!r}: dense solves none of its tasks "
                         f"(mean >= {min_dense_score})")
    # (method, budget) -> (task, protocol, context, index) -> runs (seeds)
    cells: dict[tuple[str, float | int | None], dict[tuple[object, ...], list[Record]]] = {}
    for r in records:
        if r.task in solvable:
            unit = (r.task, r.protocol, r.context, r.index)
            cells.setdefault((r.method, r.budget), {}).setdefault(unit, []).append(r)
    dense_units = cells[("dense", None)]
    dense_score = sum(sum(x.score for x in v) / len(v) for v in dense_units.values()) \
        / len(dense_units)
    points = []
    for (method, budget), units in cells.items():
        per_sample = [sum(x.score for x in v) / len(v) for v in units.values()]
        mean, lo, hi = bootstrap_ci(per_sample)
        fraction = sum(_kept_fraction(x) for v in units.values() for x in v) \
            / sum(len(v) for v in units.values())
        points.append(SweepPoint(family, method, budget, fraction, mean, lo, hi,
                                 len(units), dense_score))
    return sorted(points, key=lambda p: (p.method != "dense", p.method, p.fraction))


def smallest_reaching(points: Sequence[SweepPoint], method: str, share: float
                      ) -> SweepPoint | None:
    """The smallest-budget point of ``method`` whose score is at least ``share`` of
    dense's (None when no measured budget reaches it)."""
    reached = [p for p in points if p.method == method and p.budget is not None
               and p.score >= share * p.dense - 1e-12]
    return min(reached, key=lambda p: p.fraction, default=None)


def table(points: Sequence[SweepPoint], share: float) -> str:
    """A markdown table for one family: method rows, budget columns, and the smallest
    budget reaching ``share`` of dense."""
    swept = [p for p in points if p.budget is not None]
    budgets = sorted({p.budget for p in swept}, key=lambda b: float(b))  # type: ignore[arg-type]
    frac = {b: sum(p.fraction for p in swept if p.budget == b)
            / sum(1 for p in swept if p.budget == b) for b in budgets}
    dense = points[0].dense
    head = ("| method | " + " | ".join(f"{b} ({frac[b]:.0%})" for b in budgets)
            + f" | smallest at ≥ {share:.0%} of dense ({share * dense:.2f}) |")
    lines = [f"dense {dense:.2f}", "", head, "|---|" + "---|" * (len(budgets) + 1)]
    for method in dict.fromkeys(p.method for p in swept):
        by = {p.budget: p for p in swept if p.method == method}
        best = smallest_reaching(points, method, share)
        cells = [f"{by[b].score:.2f}" if b in by else "–" for b in budgets]
        lines.append(f"| {method} | " + " | ".join(cells) + " | "
                     + ("not reached" if best is None
                        else f"{best.budget} ({best.fraction:.0%})") + " |")
    return "\n".join(lines)


def plot_sweeps(families: dict[str, list[SweepPoint]], path: pathlib.Path, *,
                share: float) -> pathlib.Path:
    """One panel per family: score against the kept fraction of the prompt per method
    (95% bands), dense's score and ``share`` of it as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncol = min(4, len(families))
    nrow = -(-len(families) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
    # One color per method across every panel, so a method reads the same everywhere.
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    methods = dict.fromkeys(p.method for ps in families.values() for p in ps
                            if p.budget is not None)
    colors = {m: cycle[i % len(cycle)] for i, m in enumerate(methods)}
    for ax, (family, points) in zip(axes.flat, families.items()):
        dense = points[0].dense
        ax.axhline(dense, color="k", lw=1, ls=":", label="dense")
        ax.axhline(share * dense, color="0.5", lw=1, ls="--", label=f"{share:.0%} of dense")
        for method in dict.fromkeys(p.method for p in points if p.budget is not None):
            pts = sorted((p for p in points if p.method == method and p.budget is not None),
                         key=lambda p: p.fraction)
            xs = [100 * p.fraction for p in pts]
            ours = method.startswith("nexus")
            ax.plot(xs, [p.score for p in pts], "-o" if ours else "--s", label=method,
                    color=colors[method], lw=2 if ours else 1, ms=5 if ours else 4)
            ax.fill_between(xs, [p.lo for p in pts], [p.hi for p in pts],
                            color=colors[method], alpha=0.12)
        ax.set_title(f"{family} (n={points[0].n})", fontsize=9)
        ax.set_xlabel("budget (% of the prompt kept)")
        ax.set_ylabel("score (tasks dense solves)", fontsize=8)
        ax.set_xlim(0, 100)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(families):]:
        ax.axis("off")
    handles: dict[str, Artist] = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    legend_cols = max(2, min(len(handles), 2 * ncol))
    legend_rows = -(-len(handles) // legend_cols)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=legend_cols,
               fontsize=8)
    fig.tight_layout(rect=(0, (0.02 + 0.045 * legend_rows) / nrow, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _family(text: str) -> tuple[str, list[pathlib.Path]]:
    name, sep, files = text.partition("=")
    if not sep or not name or not files:
        raise argparse.ArgumentTypeError(
            f"a family is NAME=RECORDS.jsonl[,MORE.jsonl], got {text!r}")
    return name, [pathlib.Path(f) for f in files.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nexus-vllm sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("families", nargs="+", type=_family, metavar="NAME=RECORDS",
                   help="a family's records.jsonl files, comma-separated")
    p.add_argument("--method", action="append", default=[], metavar="METHOD",
                   help="keep only these methods (repeatable; dense is always kept; "
                        "default: all)")
    p.add_argument("--share", type=float, default=0.9,
                   help="the share of dense's score a budget must keep (default 0.9)")
    p.add_argument("--plot", type=pathlib.Path, default=None, help="write the panels here")
    p.add_argument("--json", type=pathlib.Path, default=None, help="write the points here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not 0 < args.share <= 1:
        p.error(f"--share must be in (0, 1], got {args.share}")
    families: dict[str, list[SweepPoint]] = {}
    for name, files in args.families:
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            p.error(f"family {name!r}: no such records file {', '.join(missing)}")
        # A record found in several files (a seeded run and its source) counts once.
        by_key: dict[str, Record] = {}
        for r in read_records(*files):
            if not args.method or r.method == "dense" or r.method in args.method:
                by_key.setdefault(r.key, r)
        records = list(by_key.values())
        try:
            families[name] = sweep_points(name, records)
        except ValueError as exc:
            p.error(str(exc))
    for name, points in families.items():
        print(f"## {name}\n\n{table(points, args.share)}\n")
    if args.plot is not None:
        plot_sweeps(families, args.plot, share=args.share)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(
            {"share": args.share,
             "points": [dataclasses.asdict(p) for ps in families.values() for p in ps]},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
