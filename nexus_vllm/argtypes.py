"""argparse value types shared by the ``--kv-*`` server flags and the ``nexus-vllm``
subcommands, so a bad number is refused with the same message everywhere (argparse names
the flag); and how an error message shows a value the user gave (:func:`describe_value`)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

__all__ = ["describe_value", "float_in", "int_at_least"]


def int_at_least(low: int, meaning: str | None = None) -> Callable[[str], int]:
    """argparse type: an int >= ``low``; errors say ``must be {meaning}`` (default
    ``an integer >= {low}``)."""
    meaning = meaning or f"an integer >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {meaning}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {meaning}, got {text!r}")
        return value

    return parse


def float_in(low: float, high: float | None = None, *, low_open: bool = True,
             meaning: str | None = None) -> Callable[[str], float]:
    """argparse type: a finite float above ``low`` (at least ``low`` with ``low_open``
    false) and, given ``high``, at most ``high``; errors say ``must be {meaning}`` (default
    ``a number > {low}``, ``a number >= {low}`` or ``a number in ({low}, {high}]``)."""
    if meaning is None:
        if high is None:
            meaning = f"a number {'>' if low_open else '>='} {low:g}"
        else:
            meaning = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {meaning}, got {text!r}") from None
        above = value > low if low_open else value >= low
        if not (math.isfinite(value) and above and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"must be {meaning}, got {text!r}")
        return value

    return parse


def describe_value(value: Any) -> str:
    """``value`` as the user gave it, with its JSON type when that is the problem."""
    text = repr(value)
    if len(text) > 40:  # a huge number or string: enough to recognise it
        text = f"{text[:30]}... ({len(text)} characters)"
    kind = {bool: "a boolean", str: "a string", list: "a list", dict: "an object",
            type(None): "null"}.get(type(value))
    return f"{text} ({kind})" if kind else text
