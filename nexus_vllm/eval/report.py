"""Markdown tables and matplotlib plots from evaluation records and aggregated rows, and
:func:`write_reports`, which writes all of them for one run directory."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from nexus_vllm.core import cdiv
from nexus_vllm.eval.tasks import task_metric

if TYPE_CHECKING:
    from nexus_vllm.eval.records import Record
    from nexus_vllm.eval.runner import RunConfig

__all__ = ["calibration_table", "markdown_table", "plot_bars", "plot_turns", "plot_vs_budget",
           "summary_table", "tasks_dense_solves", "turn_means", "turn_table",
           "write_reports"]

_LABELS = {"score": "score (string match)", "delta_loglik": "Δ answer log-lik vs dense",
           "kl": "KL(dense‖method) per token"}


def _scored_against_dense(tasks: Iterable[str]) -> list[str]:
    """The tasks among ``tasks`` whose score is ROUGE-L F1 against dense's answer, not
    string match (:func:`~nexus_vllm.eval.tasks.task_metric` ``"dense"``)."""
    return sorted({t for t in tasks if task_metric(t) == "dense"})


def tasks_dense_solves(records: Iterable[Record], min_dense_score: float = 0.5) -> set[str]:
    """The tasks whose dense mean score is at least ``min_dense_score``: the ones a pooled
    score reads (the calibration rule: a task dense cannot do says nothing about
    eviction)."""
    dense_by_task: dict[str, list[float]] = {}
    for r in records:
        if r.method == "dense":
            dense_by_task.setdefault(r.task, []).append(r.score)
    return {t for t, v in dense_by_task.items() if sum(v) / len(v) >= min_dense_score}


def _label(metric: str, tasks: Iterable[str]) -> str:
    """A plot axis's label for ``metric`` over ``tasks``."""
    names = set(tasks)
    dense = _scored_against_dense(names)
    if metric != "score" or not dense:
        return _LABELS.get(metric, metric)
    if len(dense) == len(names):
        return "score (ROUGE-L F1 vs dense)"
    return f"score (string match; {', '.join(dense)}: ROUGE-L vs dense)"


def _score_title(tasks: Iterable[str]) -> str:
    """The score section's title over ``tasks``."""
    dense = _scored_against_dense(tasks)
    if not dense:
        return "Score (RULER string match, 0-1)"
    return (f"Score (0-1; RULER string match, {', '.join(dense)}: ROUGE-L F1 against "
            "dense's answer)")


def _fmt(row: dict[str, Any], m: str, digits: int) -> str:
    v, lo, hi = row[m], row[f"{m}_lo"], row[f"{m}_hi"]
    if lo == hi:
        return f"{v:.{digits}f}"
    return f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def markdown_table(rows: list[dict[str, Any]], *, metric: str = "score",
                   budget: float | int | None = None, digits: int = 2) -> str:
    """One table: rows = method, columns = task/protocol, cells = mean [95% CI].

    ``budget`` selects one budget (dense rows are always included); ``None`` keeps every
    budget as separate method rows (``method @ budget``).
    """
    sel = [r for r in rows if budget is None or r["budget"] in (budget, None)]
    cols = sorted({(r["task"], r["protocol"], r["context"]) for r in sel})
    methods: list[str] = []
    for r in sel:
        name = r["method"] if r["budget"] is None or budget is not None else \
            f"{r['method']} @ {r['budget']}"
        if name not in methods:
            methods.append(name)
    cell: dict[tuple[str, tuple[Any, ...]], str] = {}
    means: dict[str, list[float]] = {}
    for r in sel:
        name = r["method"] if r["budget"] is None or budget is not None else \
            f"{r['method']} @ {r['budget']}"
        cell[(name, (r["task"], r["protocol"], r["context"]))] = _fmt(r, metric, digits)
        means.setdefault(name, []).append(float(r[metric]))
    head = ("| method | " + " | ".join(f"{t} ({p}, {c})" for t, p, c in cols)
            + " | mean of columns |")
    sep = "|---|" + "---|" * (len(cols) + 1)
    lines = [head, sep]
    for m in methods:
        avg = sum(means[m]) / len(means[m]) if len(means[m]) == len(cols) else float("nan")
        lines.append(f"| {m} | " + " | ".join(cell.get((m, c), "–") for c in cols)
                     + f" | **{avg:.{digits}f}** |")
    return "\n".join(lines)


def calibration_table(rows: list[dict[str, Any]]) -> str:
    """Dense accuracy per task (rows) and protocol/context (columns)."""
    dense = [r for r in rows if r["method"] == "dense"]
    tasks = sorted({r["task"] for r in dense})
    cols = sorted({(r["protocol"], r["context"]) for r in dense})
    by = {(r["task"], r["protocol"], r["context"]): r for r in dense}
    lines = ["| task | " + " | ".join(f"{p} @ {c}" for p, c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for t in tasks:
        cells = []
        for p, c in cols:
            r = by.get((t, p, c))
            cells.append("–" if r is None else _fmt(r, "score", 2) + f" (n={r['n']})")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_vs_budget(rows: list[dict[str, Any]], path: pathlib.Path, *,
                   metric: str = "score") -> pathlib.Path:
    """Grid of panels (task x protocol): ``metric`` vs budget per method, 95% CI bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["task"], r["protocol"], r["context"]) for r in rows})
    ncol = min(4, len(panels))
    nrow = cdiv(len(panels), ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.3 * nrow), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "dense"))
    for ax, (task, proto, ctx) in zip(axes.flat, panels):
        sub = [r for r in rows if (r["task"], r["protocol"], r["context"]) == (task, proto, ctx)]
        budgets = sorted({r["budget"] for r in sub if r["budget"] is not None}, key=float)
        for m in methods:
            pts = sorted((r for r in sub if r["method"] == m), key=lambda r: float(r["budget"]))
            if not pts:
                continue
            xs = [float(r["budget"]) for r in pts]
            ys = [r[metric] for r in pts]
            style = "-o" if m.startswith("nexus") else "--."
            (line,) = ax.plot(xs, ys, style, label=m, lw=2 if m == "nexus" else 1)
            ax.fill_between(xs, [r[f"{metric}_lo"] for r in pts],
                            [r[f"{metric}_hi"] for r in pts], color=line.get_color(), alpha=0.12)
        for r in sub:
            if r["method"] == "dense" and budgets:
                ax.axhline(r[metric], color="k", lw=1, ls=":", label="dense")
        ax.set_title(f"{task} · {proto} · {ctx} tok", fontsize=9)
        ax.set_xlabel("budget (kept fraction)" if budgets and isinstance(budgets[0], float)
                      else "budget")
        ax.set_ylabel(_label(metric, [task]), fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(8, len(labels)), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bars(rows: list[dict[str, Any]], path: pathlib.Path, *, metric: str = "score",
              budget: float | int | None = None) -> pathlib.Path:
    """Grouped bars (one group per task/protocol, one bar per method) with 95% CI whiskers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sel = [r for r in rows if budget is None or r["budget"] in (budget, None)]
    groups = sorted({(r["task"], r["protocol"], r["context"]) for r in sel})
    methods = list(dict.fromkeys(r["method"] for r in sel))
    by = {(r["method"], (r["task"], r["protocol"], r["context"])): r for r in sel}
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(groups) + 2), 4.6))
    x = np.arange(len(groups))
    for i, m in enumerate(methods):
        vals, err_lo, err_hi = [], [], []
        for g in groups:
            r = by.get((m, g))
            v = r[metric] if r else np.nan
            vals.append(v)
            err_lo.append(v - r[f"{metric}_lo"] if r else 0)
            err_hi.append(r[f"{metric}_hi"] - v if r else 0)
        ax.bar(x + (i - (len(methods) - 1) / 2) * width, vals, width, label=m,
               yerr=[err_lo, err_hi], capsize=2, edgecolor="k" if m.startswith("nexus") else None,
               linewidth=1.2 if m.startswith("nexus") else 0)
    ax.set_xticks(x)
    ax.set_xticklabels([f"{t}\n{p}" for t, p, _ in groups], fontsize=7)
    ax.set_ylabel(_label(metric, (t for t, _, _ in groups)))
    ax.set_title(f"{metric} at budget {budget}" if budget is not None else metric, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=min(8, len(methods)), loc="upper center",
              bbox_to_anchor=(0.5, -0.16), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_table(records: Sequence[Record], *, budget: float | int, protocol: str | None = None,
                  min_dense_score: float = 0.5) -> str:
    """Pooled over tasks: one row per method, mean [95% CI] over (task, protocol, sample).

    The score pools only tasks whose dense score is at least ``min_dense_score`` (the
    calibration rule: tasks dense cannot do say nothing about eviction); the continuous
    metrics pool every task.
    """
    from nexus_vllm.eval.stats import bootstrap_ci

    recs = [r for r in records if (protocol is None or r.protocol == protocol)
            and r.budget in (budget, None)]
    solvable = tasks_dense_solves(recs, min_dense_score)
    methods = list(dict.fromkeys(r.method for r in recs))
    lines = ["| method | score (tasks dense solves) | Δ answer log-lik (nats) | KL per token | "
             "samples |", "|---|---|---|---|---|"]
    for m in methods:
        units: dict[tuple[str, str, int], list[Record]] = {}
        for r in recs:
            if r.method == m:
                units.setdefault((r.task, r.protocol, r.index), []).append(r)

        def ci(metric: str, tasks: set[str] | None = None,
               _units: dict[tuple[str, str, int], list[Record]] = units) -> str:
            vals = [sum(getattr(x, metric) for x in v) / len(v) for k, v in _units.items()
                    if tasks is None or k[0] in tasks]
            mean, lo, hi = bootstrap_ci(vals)
            return f"{mean:.2f} [{lo:.2f}, {hi:.2f}]"

        lines.append(f"| {m} | {ci('score', solvable)} | {ci('delta_loglik')} | {ci('kl')} | "
                     f"{len(units)} |")
    lines.append("")
    lines.append(f"Score pools {sorted(solvable)} (dense >= {min_dense_score}).")
    return "\n".join(lines)


_TURN_FIELDS = {"score": "turn_scores", "delta_loglik": "turn_delta_loglik"}


def turn_means(records: Sequence[Record], task: str, budget: float | int, metric: str
               ) -> dict[str, list[float]]:
    """Per method, the mean of ``metric`` at each turn of ``task``'s streams (seeds
    averaged within a stream first, so every stream weighs the same)."""
    per: dict[str, dict[int, list[tuple[float, ...]]]] = {}
    for r in records:
        values = getattr(r, _TURN_FIELDS[metric])
        if r.task == task and r.budget in (budget, None) and values:
            per.setdefault(r.method, {}).setdefault(r.index, []).append(values)
    out: dict[str, list[float]] = {}
    for method, streams in per.items():
        means = [[sum(col) / len(col) for col in zip(*runs)] for runs in streams.values()]
        out[method] = [sum(col) / len(col) for col in zip(*means)]
    return out


def turn_table(records: Sequence[Record], task: str, budget: float | int) -> str:
    """Rows = method, columns = turn: mean score and Δ log-lik per turn."""
    scores = turn_means(records, task, budget, "score")
    deltas = turn_means(records, task, budget, "delta_loglik")
    turns = max(len(v) for v in scores.values())
    head = "| method | " + " | ".join(f"turn {t + 1}" for t in range(turns)) + " |"
    lines = [head, "|---" * (turns + 1) + "|"]
    for m, vals in scores.items():
        cells = [f"{v:.2f} / {d:+.1f}" for v, d in zip(vals, deltas[m])]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: mean score / mean Δ answer log-lik vs dense (nats), per turn."]
    return "\n".join(lines)


def plot_turns(records: Sequence[Record], task: str, budget: float | int,
               path: pathlib.Path) -> pathlib.Path:
    """Score and Δ log-lik per turn (one line per method): where in a conversation a
    policy loses its facts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric in zip(axes, ("score", "delta_loglik")):
        for m, vals in turn_means(records, task, budget, metric).items():
            ax.plot(range(1, len(vals) + 1), vals, marker="o", label=m,
                    linewidth=2 if m.startswith("nexus") else 1.2)
        ax.set_xlabel("turn")
        ax.set_ylabel(_label(metric, [task]))
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{task} at budget {budget}: per turn", fontsize=9)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# Report sections per metric: (record field, section title, digits); the score's title
# names how its tasks are scored (:func:`_score_title`).
_TABLES = (("score", "Score", 2),
           ("delta_loglik", "Δ answer log-likelihood vs dense (nats)", 2),
           ("kl", "KL(dense ‖ method), mean per token (nats)", 3))


def write_reports(out: pathlib.Path, cfg: RunConfig, records: Sequence[Record], *,
                  calibrate: bool) -> None:
    """Write ``results.json`` and ``table.md`` (or ``calibration.md``) and the plots.

    Parameters
    ----------
    out : Path
        The run directory.
    cfg : RunConfig
        Written into ``results.json``.
    records : sequence of Record
        Every record to report (ours and any peer's).
    calibrate : bool
        Write the dense calibration table instead of the method tables and plots.
    """
    from nexus_vllm.eval.runner import config_dict
    from nexus_vllm.eval.stats import aggregate

    rows = aggregate(records)
    (out / "results.json").write_text(json.dumps(
        {"config": config_dict(cfg), "rows": rows}, indent=1))
    parts = [f"# Results: {out}\n", "Cells: mean [95% bootstrap CI over samples].\n"]
    if calibrate:
        dense = ", ".join(_scored_against_dense(r["task"] for r in rows))
        how = f"string match; {dense}: ROUGE-L F1 against dense, 1 by definition" if dense \
            else "string match"
        parts += [f"## Dense calibration ({how})\n", calibration_table(rows), ""]
        (out / "calibration.md").write_text("\n".join(parts) + "\n")
        return
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None}, key=float)
    protocols = sorted({r.protocol for r in records})
    for b in budgets:
        for proto in [*protocols, None] if len(protocols) > 1 else [None]:
            parts += [f"## Summary at budget {b}, {proto or 'all protocols'} "
                      "(pooled over tasks)\n", summary_table(records, budget=b, protocol=proto),
                      ""]
    for metric, title, digits in _TABLES:
        if metric == "score":
            title = _score_title(r["task"] for r in rows)
        for b in budgets:
            parts += [f"## {title} at budget {b}\n", markdown_table(rows, metric=metric,
                                                                      budget=b, digits=digits), ""]
    multi_turn = sorted({r.task for r in records if len(r.turn_scores) > 1})
    for task in multi_turn:
        for b in budgets:
            parts += [f"## Per turn: {task} at budget {b}\n", turn_table(records, task, b), ""]
            plot_turns(records, task, b, out / f"turns_{task}_{b}.png")
    (out / "table.md").write_text("\n".join(parts) + "\n")
    for metric, _, _ in _TABLES:
        if len(budgets) > 1:
            plot_vs_budget(rows, out / f"plot_{metric}.png", metric=metric)
        for b in budgets:
            plot_bars(rows, out / f"bars_{metric}_{b}.png", metric=metric, budget=b)
