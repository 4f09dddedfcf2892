"""Statistics over evaluation records: bootstrap intervals, per-cell aggregates, and the
paired comparison of two methods on the same samples."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nexus_vllm.eval.records import Record

__all__ = ["METRICS", "PairedComparison", "aggregate", "bootstrap_ci", "paired_comparison",
           "sign_test"]

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
    groups: dict[tuple[str, int, str, str, float | int | None], dict[int, list[Record]]] = {}
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


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test: the probability, if either method were as likely to
    come out ahead on a sample, of a split at least as uneven as ``wins``/``losses``
    (ties are left out before calling). 1.0 when there is nothing to test."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


@dataclass(frozen=True)
class PairedComparison:
    """Method ``a`` against method ``b`` on the samples both ran (``a - b`` per sample).

    ``verdict`` is ``"better"`` / ``"worse"`` when the 95% bootstrap interval of the mean
    difference excludes 0 (in the metric's good direction), else ``"not
    distinguishable"``; ``p_sign`` is the exact sign test on the per-sample wins.
    """

    metric: str
    a: str
    b: str
    n: int
    mean_diff: float
    low: float
    high: float
    wins: int
    losses: int
    ties: int
    p_sign: float
    verdict: str

    def line(self) -> str:
        """One human sentence, the form the docs quote."""
        return (f"{self.a} vs {self.b} on {self.metric}: {self.verdict} "
                f"(mean difference {self.mean_diff:+.3f} [{self.low:+.3f}, {self.high:+.3f}] "
                f"over {self.n} paired samples; {self.wins} wins, {self.losses} losses, "
                f"{self.ties} ties; sign test p = {self.p_sign:.3f})")


# Metrics where smaller is better (the verdict flips its sign).
_LOWER_IS_BETTER = frozenset({"kl", "kl_answer"})


def paired_comparison(records: Sequence[Record], a: str, b: str, *, metric: str = "score",
                      n_boot: int = 2000, seed: int = 0) -> PairedComparison:
    """Compare methods ``a`` and ``b`` sample by sample.

    Records pair on (task, context, protocol, index, budget); seeds are averaged within a
    sample first (as :func:`aggregate` does), and samples only one method ran are left
    out.

    Raises
    ------
    ValueError
        For an unknown metric, or when the two methods share no sample.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}; got {metric!r}")
    per: dict[str, dict[tuple[str, int, str, int, float | int | None], list[float]]] = {
        a: {}, b: {}}
    for r in records:
        if r.method in per:
            unit = (r.task, r.context, r.protocol, r.index, r.budget)
            per[r.method].setdefault(unit, []).append(float(getattr(r, metric)))
    shared = sorted(set(per[a]) & set(per[b]), key=repr)
    if not shared:
        raise ValueError(f"methods {a!r} and {b!r} share no sample "
                         f"(runs: {len(per[a])} and {len(per[b])} samples)")
    diffs = np.array([np.mean(per[a][u]) - np.mean(per[b][u]) for u in shared])
    mean, lo, hi = bootstrap_ci(diffs, n_boot=n_boot, seed=seed)
    sign = -1.0 if metric in _LOWER_IS_BETTER else 1.0
    wins = int(np.sum(sign * diffs > 0))
    losses = int(np.sum(sign * diffs < 0))
    good_lo, good_hi = sorted((sign * lo, sign * hi))
    verdict = ("better" if good_lo > 0 else "worse" if good_hi < 0
               else "not distinguishable")
    return PairedComparison(metric=metric, a=a, b=b, n=len(shared), mean_diff=mean, low=lo,
                            high=hi, wins=wins, losses=losses, ties=len(shared) - wins - losses,
                            p_sign=sign_test(wins, losses), verdict=verdict)
