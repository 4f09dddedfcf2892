"""Shared argument checks: every bad input raises :class:`ConfigError` (a ``ValueError``)
naming the argument in its message and in ``.field``, so callers map it to a flag or a
request field without parsing the message."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

_T = TypeVar("_T")


class ConfigError(ValueError):
    """A bad setting; ``field`` is the argument's name (e.g. ``"max_tokens"``) and
    ``reads`` the other fields its rule read (a rule between fields: ``max_tokens`` under
    the forced set reads ``block_size``, ``sink_blocks`` and ``recent_blocks``), so a
    caller maps ``field`` or one of ``reads`` to the flag or request field that set it."""

    def __init__(self, field: str, message: str, *, reads: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.field = field
        self.reads = tuple(reads)


def check_choice(name: str, value: object, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(name, f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"{name} must be an int; got {value!r}")
    if low is not None and value < low:
        raise ConfigError(name, f"{name} must be >= {low}; got {value}")
    if high is not None and value > high:
        raise ConfigError(name, f"{name} must be <= {high}; got {value}")


def check_float(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(name, f"{name} must be a finite number; got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ConfigError(name, f"{name} must be {'>' if low_open else '>='} {low}; got {value}")
    if high is not None and value > high:
        raise ConfigError(name, f"{name} must be <= {high}; got {value}")


def check_weights(name: str, weights: torch.Tensor) -> None:
    if not isinstance(weights, torch.Tensor) or weights.dim() != 1:
        shape = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights)
        raise ConfigError(name, f"{name} must be a 1-D tensor; got {shape}")
    if weights.numel() and not bool(torch.isfinite(weights).all()):
        raise ConfigError(name, f"{name} must be finite (no NaN or inf)")
    if weights.numel() and bool((weights < 0).any()):
        raise ConfigError(name, f"{name} must be non-negative")


def check_mass(mass: torch.Tensor, *, row_sum_tolerance: float | None = None) -> None:
    """A block attention mass ``[W, N]``: 2-D, finite, non-negative; with
    ``row_sum_tolerance``, also each row summing to 1 within it (or all zeros: a query
    that attended to nothing, e.g. padding)."""
    if not isinstance(mass, torch.Tensor) or mass.dim() != 2:
        shape = tuple(mass.shape) if isinstance(mass, torch.Tensor) else type(mass)
        raise ValueError(f"mass must be a 2-D tensor [W, N]; got {shape}")
    if mass.numel() and not bool(torch.isfinite(mass).all()):
        raise ValueError("mass must be finite (no NaN or inf)")
    if mass.numel() and bool((mass < 0).any()):
        raise ValueError("mass must be non-negative")
    if row_sum_tolerance is not None and mass.numel():
        sums = mass.detach().double().sum(dim=1)
        bad = ((sums - 1.0).abs() > row_sum_tolerance) & (sums != 0)
        if bool(bad.any()):
            row = int(torch.nonzero(bad)[0])
            raise ValueError(f"mass rows must sum to 1 (attention over the live blocks); "
                             f"row {row} sums to {float(sums[row]):.6g}")


def shipped_or_file(ref: str, directory: pathlib.Path, suffix: str, field: str,
                    what: str) -> pathlib.Path:
    """The file ``ref`` names: a path, or a name shipped in ``directory`` as
    ``<ref><suffix>``; else a :class:`ConfigError` naming ``field`` that lists what ships."""
    path = pathlib.Path(ref)
    if not path.is_file():
        path = directory / f"{ref}{suffix}"
    if not path.is_file():
        shipped = sorted(p.stem for p in directory.glob(f"*{suffix}"))
        raise ConfigError(field, f"{field} {ref!r} is neither a file nor a shipped {what} "
                                 f"({', '.join(shipped) or 'none'})")
    return path


def load_shipped_or_file(ref: str, directory: pathlib.Path, suffix: str, field: str,
                         what: str, read: Callable[[pathlib.Path], _T],
                         errors: tuple[type[Exception], ...]) -> _T:
    """``read`` of the file ``ref`` names (:func:`shipped_or_file`); any of ``errors`` it
    raises becomes a :class:`ConfigError` naming ``field``: ``<field> '<ref>': not a
    <field, in words> (<the error>)``. A :class:`ConfigError` from ``read`` passes as it
    is."""
    path = shipped_or_file(ref, directory, suffix, field, what)
    try:
        return read(path)
    except errors as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(field, f"{field} {ref!r}: not a {field.replace('_', ' ')} "
                                 f"({exc})") from None
