"""Statistics over evaluation records: bootstrap intervals and per-cell aggregates."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from nexus_vllm.eval.records import Record

__all__ = ["METRICS", "aggregate", "bootstrap_ci"]

# Record fields aggregated per cell (each gets a mean and a 95% interval).
METRICS = ("score", "delta_loglik", "kl", "kl_answer")


def bootstrap_ci(values: Iterable[float], *, n_boot: int = 2000, alpha: float = 0.05,
                 seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap interval of the mean (95% by default).

    Parameters
    ----------
    values : iterable of float
        One value per unit (a sample); NaN-free.
    n_boot : int
        Bootstrap resamples.
    alpha : float
        1 - coverage.
    seed : int
        Seeds the resampling, so tables are reproducible.

    Returns
    -------
    (mean, low, high); all NaN for no values, all the mean when the values are equal.
    """
    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if x.size == 1 or np.all(x == x[0]):
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    boots = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return mean, float(lo), float(hi)


def aggregate(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Mean and 95% CI per (task, context, protocol, method, budget).

    Seeds are averaged within a sample first, so the interval is over samples (the unit
    that varies the data), not inflated by sampler seeds.

    Returns
    -------
    list of dict, one row per cell (the rows of ``results.json``): the cell's fields,
    ``n`` samples, ``runs``, ``<metric>``, ``<metric>_lo``, ``<metric>_hi`` for each of
    :data:`METRICS`, and the mean ``seconds`` per run.
    """
    groups: dict[tuple[Any, ...], dict[int, list[Record]]] = {}
    for r in records:
        g = (r.task, r.context, r.protocol, r.method, r.budget)
        groups.setdefault(g, {}).setdefault(r.index, []).append(r)
    # Methods in the order they were run (dense first), everything else sorted.
    order = {m: i for i, m in enumerate(dict.fromkeys(r.method for r in records))}
    rows = []
    for (task, context, protocol, method, budget), by_sample in sorted(
            groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2], order[kv[0][3]],
                                            -1.0 if kv[0][4] is None else float(kv[0][4]))):
        row: dict[str, Any] = {"task": task, "context": context, "protocol": protocol,
                               "method": method, "budget": budget, "n": len(by_sample),
                               "runs": sum(len(v) for v in by_sample.values())}
        for m in METRICS:
            per_sample = [float(np.mean([getattr(r, m) for r in rs]))
                          for rs in by_sample.values()]
            mean, lo, hi = bootstrap_ci(per_sample)
            row[m], row[f"{m}_lo"], row[f"{m}_hi"] = mean, lo, hi
        row["seconds"] = float(np.mean([r.seconds for rs in by_sample.values() for r in rs]))
        rows.append(row)
    return rows
