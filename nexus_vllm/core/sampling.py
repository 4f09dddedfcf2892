"""Choosing K blocks out of N by weight: exact-inclusion PPS, A-Res, or top-K.

All samplers run on the CPU in float64: they are O(N) per event and N is the number of
blocks of one request (hundreds to a few thousand), so exactness beats speed here.
"""

from __future__ import annotations

import torch

from ._validate import check_choice, check_int, check_weights

__all__ = ["SAMPLERS", "inclusion_probabilities", "sample_blocks"]

SAMPLERS = ("pps", "ares", "topk")


def _check_k(k: int, n: int) -> None:
    check_int("k", k, low=0)
    if k > n:
        raise ValueError(f"k must be <= the number of weights ({n}); got {k}")


def inclusion_probabilities(weights: torch.Tensor, k: int) -> torch.Tensor:
    """Exact first-order inclusion probabilities for drawing ``k`` of ``N`` items by weight.

    ``pi_j = min(1, c * w_j)`` with ``c`` chosen so that ``sum(pi) == k``: items whose
    scaled weight reaches 1 are capped (always kept) and ``c`` is re-solved over the rest
    until no new item caps.

    Parameters
    ----------
    weights : Tensor[N]
        Non-negative, finite.
    k : int
        ``0 <= k <= N``.

    Returns
    -------
    Tensor[N] (float64, CPU), each in ``[0, 1]``, summing to ``k``. When fewer than ``k``
    weights are positive, those are certain and the remaining mass is shared equally by
    the zero-weight items (a draw of exactly ``k`` must take some of them).
    """
    check_weights("weights", weights)
    n = weights.numel()
    _check_k(k, n)
    w = weights.detach().to("cpu", torch.float64)
    pi = torch.zeros(n, dtype=torch.float64)
    if k == 0:
        return pi
    positive = w > 0
    num_positive = int(positive.sum())
    if num_positive <= k:
        pi[positive] = 1.0
        if num_positive < k:
            pi[~positive] = (k - num_positive) / (n - num_positive)
        return pi
    capped = torch.zeros(n, dtype=torch.bool)
    while True:
        free = ~capped
        remaining = k - int(capped.sum())
        total = float(w[free].sum())
        if remaining == 0 or total <= 0.0:
            # Capping used up k exactly, or only zero weights are left to share the rest.
            pi = capped.double()
            if remaining:
                pi[free] = remaining / int(free.sum())
            break
        # (w / total) * remaining, not w * (remaining / total): the latter overflows to
        # inf for subnormal weights.
        pi = torch.where(capped, torch.ones_like(w), (w / total) * remaining)
        newly = free & (pi >= 1.0)
        if not bool(newly.any()):
            break
        capped |= newly
    return pi.clamp_(0.0, 1.0)


def _systematic(pi: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """Systematic sampling in a random order: exactly ``k`` picks, ``P(j) = pi_j``."""
    n = pi.numel()
    order = torch.randperm(n, generator=generator)
    cum = torch.cumsum(pi[order], dim=0)
    cum = cum * (k / float(cum[-1]))  # remove float drift so the last edge is exactly k
    start = float(torch.rand((), generator=generator, dtype=torch.float64))
    points = start + torch.arange(k, dtype=torch.float64)
    slots = torch.searchsorted(cum, points, right=True).clamp_(max=n - 1)
    chosen = torch.unique(order[slots])
    if chosen.numel() < k:
        # Only reachable through rounding when an interval is a hair over 1: top up with
        # the most probable unchosen items so the budget is still met exactly.
        rest = torch.ones(n, dtype=torch.bool)
        rest[chosen] = False
        extra = torch.nonzero(rest).flatten()
        extra = extra[top_k_indices(pi[extra], k - chosen.numel())]
        chosen = torch.cat([chosen, extra])
    return chosen


def _ares(w: torch.Tensor, k: int, n: int, generator: torch.Generator | None) -> torch.Tensor:
    # Scale-free keys: A-Res with n > 1 averages u^(1/w), which depends on the scale of w.
    scaled = w / float(w.max()) if float(w.max()) > 0 else torch.ones_like(w)
    u = torch.rand((n, w.numel()), generator=generator, dtype=torch.float64)
    u = u.clamp_min(torch.finfo(torch.float64).tiny)
    with torch.no_grad():
        log_keys = torch.log(u) / scaled  # log(u^(1/w)); -inf for w == 0 (never preferred)
        log_mean = torch.logsumexp(log_keys, dim=0) - torch.log(torch.tensor(float(n)))
    return torch.topk(log_mean, k).indices


def top_k_indices(w: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest values (any finite scores), largest first."""
    # Stable descending sort: equal weights keep the older block, so runs are reproducible.
    return torch.argsort(w, descending=True, stable=True)[:k]


def sample_blocks(
    weights: torch.Tensor,
    k: int,
    *,
    sampler: str = "pps",
    n: int = 1,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Choose ``k`` distinct items of ``N`` by weight.

    Parameters
    ----------
    weights : Tensor[N]
        Non-negative, finite weights.
    k : int
        How many to choose, ``0 <= k <= N``.
    sampler : {"pps", "ares", "topk"}
        ``pps``: systematic sampling in random order with exact inclusion probabilities
        :func:`inclusion_probabilities`; ``ares``: keep the top-``k`` of the priority
        ``mean_i u_i^(1/w_j)`` over ``n`` uniforms (``n=1`` is Efraimidis-Spirakis A-Res,
        i.e. Gumbel-top-k); ``topk``: the ``k`` largest weights (deterministic).
    n : int
        Number of uniforms averaged by ``ares``; >= 1.
    generator : torch.Generator, optional
        CPU generator for reproducible draws.

    Returns
    -------
    LongTensor[k] (CPU), sorted ascending, unique.
    """
    check_choice("sampler", sampler, SAMPLERS)
    check_int("n", n, low=1)
    check_weights("weights", weights)
    num = weights.numel()
    _check_k(k, num)
    if k == 0:
        return torch.zeros(0, dtype=torch.long)
    if k == num:
        return torch.arange(num, dtype=torch.long)
    w = weights.detach().to("cpu", torch.float64)
    if sampler == "pps":
        chosen = _systematic(inclusion_probabilities(w, k), k, generator)
    elif sampler == "ares":
        chosen = _ares(w, k, n, generator)
    else:
        chosen = top_k_indices(w, k)
    return torch.sort(chosen.long()).values
