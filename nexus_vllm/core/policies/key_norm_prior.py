"""The key-norm prior's maths (low-norm keys draw attention: KNorm's observation), read
by Nexus's ``knorm_prior`` and by KNorm."""

from __future__ import annotations

import torch

__all__ = ["KNORM_SPREAD_FLOOR", "key_norms_are_flat", "standardized_head_norms",
           "standardized_key_norms"]

# The smallest spread of the blocks' key norms, as a share of their mean, that the
# key-norm prior reads as signal. Models that RMS-normalise each head's keys (Gemma 3's
# k_norm) can give every key the same length; standardising that by its own spread
# would turn float rounding (~1e-7, different on each TP layout) into a strong random
# prior. Real spreads are far above it (SmolLM2, Gemma 3 270M: 1.5-3% of the mean).
KNORM_SPREAD_FLOOR = 1e-3


def standardized_key_norms(norms: torch.Tensor) -> torch.Tensor:
    """Blocks' key norms as z-scores, the spread floored at ``KNORM_SPREAD_FLOOR * mean``.

    Parameters
    ----------
    norms : Tensor[N]
        Mean key norm of each live block.

    Returns
    -------
    Tensor[N] (float64): ``(norms - mean) / max(std, KNORM_SPREAD_FLOOR * |mean|)``;
    near-constant norms give near-zero z (a flat prior).
    """
    x = norms.to(torch.float64).flatten()
    mean = x.mean()
    floor = (KNORM_SPREAD_FLOOR * mean.abs()).clamp(min=1e-12)
    return (x - mean) / torch.maximum(x.std(unbiased=False), floor)


def key_norms_are_flat(norms: torch.Tensor) -> bool:
    """Whether the blocks' key norms (Tensor[N]) spread less than ``KNORM_SPREAD_FLOOR``
    of their mean: every key the same length up to rounding, so their order is noise."""
    x = norms.to(torch.float64).flatten()
    return bool(x.std(unbiased=False) < KNORM_SPREAD_FLOOR * x.mean().abs())


def standardized_head_norms(norms: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Key norms ``[L, H, T]`` standardised within each (layer, head) over its live
    entries (0 on dead ones, and where a head's norms are flat:
    :data:`KNORM_SPREAD_FLOOR`)."""
    w = live.float()
    count = w.sum(dim=-1, keepdim=True).clamp_min(1.0)
    mean = (norms * w).sum(dim=-1, keepdim=True) / count
    std = (((norms - mean) * w).square().sum(dim=-1, keepdim=True) / count).sqrt()
    std = torch.maximum(std, KNORM_SPREAD_FLOOR * mean.abs()).clamp_min(1e-12)
    return ((norms - mean) / std * w).float()
