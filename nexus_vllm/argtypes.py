"""argparse value types shared by the ``--kv-*`` server flags and the ``nexus-vllm``
subcommands, so a bad number is refused with the same message everywhere (argparse names
the flag)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["int_at_least"]


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
