"""Per-model head profiles: a fixed allocation of the budget over (layer, KV head),
calibrated offline (``scripts/calibrate_head_profile.py``) and shipped in
``head_profiles/``, that :func:`~nexus_vllm.core.head_paged.select_head_units` fills with
each head's own best entries (``head_profile`` in the config).

* :class:`HeadProfile`: one allocation, checked;
* :func:`load_head_profile`: a shipped one by name, or a JSON file's path.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass

import torch

from ._validate import ConfigError, load_shipped_or_file

__all__ = ["PROFILES_DIR", "HeadProfile", "load_head_profile"]

# The shipped per-model allocations (``head_profile`` by name): scripts/calibrate_head_profile.py
PROFILES_DIR = pathlib.Path(__file__).with_name("head_profiles")


@dataclass(frozen=True)
class HeadProfile:
    """A per-model allocation of the budget over (layer, KV head), calibrated offline.

    Attributes
    ----------
    model : str
        The model it was calibrated on.
    shares : tuple of tuple of float
        ``[full-attention layers][KV heads]``: each head's share of the kept entries.
    budget_share : float
        The budget, as a share of the context, it was calibrated at.
    source : str
        How it was made (the command and the text).
    """

    model: str
    shares: tuple[tuple[float, ...], ...]
    budget_share: float
    source: str

    def __post_init__(self) -> None:
        widths = {len(row) for row in self.shares}
        if not self.shares or len(widths) != 1 or min(widths) < 1:
            raise ConfigError("head_profile", "a head profile's shares must be a non-empty "
                                              "[layers][KV heads] table")
        if any(not math.isfinite(x) or x < 0 for row in self.shares for x in row) \
                or sum(map(sum, self.shares)) <= 0:
            raise ConfigError("head_profile", "a head profile's shares must be finite, "
                                              "non-negative and not all 0")

    def tensor(self) -> torch.Tensor:
        """The shares as Tensor[L, Hkv] (float64)."""
        return torch.tensor(self.shares, dtype=torch.float64)


def load_head_profile(ref: str) -> HeadProfile:
    """A shipped profile by name (``smollm2-135m-instruct``) or a JSON file's path.

    Raises
    ------
    ConfigError
        Naming ``head_profile``: no such profile, or not a profile.
    """
    return load_shipped_or_file(ref, PROFILES_DIR, ".json", "head_profile", "profile",
                                _read_head_profile, (ValueError, KeyError, TypeError))


def _read_head_profile(path: pathlib.Path) -> HeadProfile:
    data = json.loads(path.read_text())
    return HeadProfile(model=str(data["model"]),
                       shares=tuple(tuple(float(x) for x in row) for row in data["shares"]),
                       budget_share=float(data["budget_share"]),
                       source=str(data.get("source", "")))
