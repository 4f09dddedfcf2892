"""Nexus block weights: direct attention plus an indirect ("bridge") score.

The direct score ``a`` says how much the window attends to a block. The indirect score
lifts blocks that many window queries support moderately (bridges between facts), which
a direct top-K misses because no single query points at them strongly.
"""

from __future__ import annotations

import torch

from ._validate import ConfigError, check_choice, check_float, check_int, check_mass
from .scoring import normalize_rows

__all__ = ["DIRECT_MODES", "INDIRECT_MODES", "WALK_ROWS", "check_indirect", "direct_scores",
           "indirect_scores", "nexus_weights"]

DIRECT_MODES = ("mean", "max")
INDIRECT_MODES = ("walk", "none")
WALK_ROWS = ("newest", "oldest", "cycle")


# Modes that chose exactly as "none" for row-normalised mass (docs/algorithm.md), removed:
# a config naming one gets told so instead of a bare "must be one of".
_REMOVED_MODES = {
    "hub": "its column sums are proportional to the direct score",
    "ppr": "the direct score is the stationary vector of its co-attention walk",
}


def check_indirect(name: str, value: object) -> None:
    """Validate an indirect mode, with a pointer for configs that still name a removed one
    (``hub``, ``ppr``)."""
    if isinstance(value, str) and value in _REMOVED_MODES:
        raise ConfigError(name, f"{name}={value!r} was removed: for row-normalised mass "
                                f"{_REMOVED_MODES[value]}, so it was 'none' in disguise; "
                                "use 'none' or 'walk'")
    check_choice(name, value, INDIRECT_MODES)


def direct_scores(mass: torch.Tensor, reduce: str = "mean",
                  row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """How much the window attends to each block.

    Parameters
    ----------
    mass : Tensor[W, N]
    reduce : {"mean", "max"}
        ``mean`` (the paper's): the mean over the rows, each normalised to sum to 1.
        ``max``: each block's largest share of any one row as the scorer gave it (rows
        times ``row_scale``), normalised to sum to 1; a block that one row of the
        question reads closely is not diluted by the rows that read elsewhere (several
        facts asked at once, a chat's earlier turns; docs/algorithm.md, "The chat
        shape").
    row_scale : Tensor[W], optional
        Each row's total before it was renormalised
        (:attr:`~nexus_vllm.core.policies.Evidence.row_scale`); read by ``max`` only.

    Returns
    -------
    Tensor[N] (float64), summing to 1 when any row has mass.
    """
    check_mass(mass)
    check_choice("direct", reduce, DIRECT_MODES)
    if mass.shape[0] == 0:
        return torch.zeros(mass.shape[1], dtype=torch.float64, device=mass.device)
    if reduce == "max":
        rows = mass.double()
        if row_scale is not None:
            rows = rows * row_scale.to(rows).view(-1, 1)
        return normalize_rows(rows.amax(dim=0))
    return normalize_rows(mass.double()).mean(dim=0)


def _walk_row_order(w: int, steps: int, walk_rows: str) -> list[int]:
    if walk_rows == "newest":
        return [w - 1 - (h % w) for h in range(steps)]
    if walk_rows == "oldest":
        return [h % w for h in range(steps)]
    # "cycle": spread the H steps evenly over the whole window, newest first, so a short
    # walk still sees both ends of it.
    stride = max(1, w // max(1, steps))
    return [(w - 1 - h * stride) % w for h in range(steps)]


def indirect_scores(
    mass: torch.Tensor,
    *,
    indirect: str = "walk",
    steps: int = 3,
    walk_rows: str = "newest",
) -> torch.Tensor:
    """Un-normalised indirect score ``c`` (see the spec, step 3).

    Parameters
    ----------
    mass : Tensor[W, N]
        Block attention mass of the window queries.
    indirect : {"walk", "none"}
        ``walk``: ``C <- C + S_q * (1 + S_q . C)`` over ``steps`` chosen rows ``q`` of the
        row-normalised mass ``S``; ``none``: zeros.

    Returns
    -------
    Tensor[N] (float64)
    """
    check_mass(mass)
    check_indirect("indirect", indirect)
    check_choice("walk_rows", walk_rows, WALK_ROWS)
    check_int("steps", steps, low=1)
    w, n = mass.shape
    if w == 0 or indirect == "none":
        return torch.zeros(n, dtype=torch.float64, device=mass.device)
    s = normalize_rows(mass.double())
    c = torch.zeros(n, dtype=torch.float64, device=mass.device)
    for q in _walk_row_order(w, steps, walk_rows):
        row = s[q]
        c = c + row * (1.0 + torch.dot(row, c))
    return c


def nexus_weights(
    mass: torch.Tensor,
    *,
    row_scale: torch.Tensor | None = None,
    direct: str = "mean",
    indirect: str = "walk",
    steps: int = 3,
    lam: float = 0.5,
    walk_rows: str = "newest",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Nexus weight of each block: ``w = a + lam * c / |c|_1 + eps * r``.

    Parameters
    ----------
    mass : Tensor[W, N]
        Attention mass each window query puts on each block (rows need not be
        normalised).
    row_scale : Tensor[W], optional
        Each row's total before it was renormalised; see :func:`direct_scores`.
    direct : {"mean", "max"}
        How the direct score ``a`` reads the rows; see :func:`direct_scores`.
    indirect : {"walk", "none"}
        How the indirect score ``c`` is built; see :func:`indirect_scores`.
    steps : int
        H, the number of walk steps; >= 1.
    lam : float
        Weight of the normalised indirect score; >= 0.
    walk_rows : {"newest", "oldest", "cycle"}
        Which window rows the walk visits.
    eps : float
        Weight of the recency ramp ``r_j = j / (N - 1)``, a tie-break only; >= 0.

    Returns
    -------
    Tensor[N] (float64), non-negative.
    """
    check_float("lam", lam, low=0.0)
    check_float("eps", eps, low=0.0)
    a = direct_scores(mass, direct, row_scale)
    c = indirect_scores(mass, indirect=indirect, steps=steps, walk_rows=walk_rows)
    n = a.numel()
    ramp = torch.arange(n, dtype=torch.float64, device=a.device) / max(n - 1, 1)
    return a + lam * normalize_rows(c) + eps * ramp
