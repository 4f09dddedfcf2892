"""argparse value types shared by the ``--kv-*`` server flags and the ``nexus-vllm``
subcommands, so a bad number is refused with the same message everywhere (argparse names
the flag); and how an error message shows a value the user gave (:func:`describe_value`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = ["describe_value", "int_at_least"]


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


def describe_value(value: Any) -> str:
    """``value`` as the user gave it, with its JSON type when that is the problem."""
    text = repr(value)
    if len(text) > 40:  # a huge number or string: enough to recognise it
        text = f"{text[:30]}... ({len(text)} characters)"
    kind = {bool: "a boolean", str: "a string", list: "a list", dict: "an object",
            type(None): "null"}.get(type(value))
    return f"{text} ({kind})" if kind else text
