"""The one parser for budgets written on a command line or in a YAML file.

The budget rule itself (a float in (0, 1] is a keep ratio, an int a token count) is
:meth:`nexus_vllm.core.EvictionConfig.from_budget`; this only turns text into the number
of the right type, so ``"0.2"`` and ``"1e-1"`` are ratios and ``"512"`` is tokens.
"""

from __future__ import annotations

__all__ = ["parse_budget"]


def parse_budget(value: str | int | float) -> float | int:
    """``"0.2"`` / ``"1e-1"`` -> 0.2 (a keep ratio), ``"512"`` -> 512 (tokens).

    Numbers (from YAML) pass through with their type. The value is not range-checked
    here: :meth:`EvictionConfig.from_budget` does that, with the method's knobs.

    Raises
    ------
    ValueError
        Naming ``budget`` when ``value`` is not a number.
    """
    if isinstance(value, bool):
        raise ValueError(f"budget must be a number (ratio or tokens), got {value!r}")
    if isinstance(value, (int, float)):
        return value
    text = str(value).strip()
    try:
        # A decimal point or an exponent makes a ratio; plain digits a token count.
        if any(c in text for c in ".eE"):
            return float(text)
        return int(text)
    except ValueError:
        raise ValueError(f"budget must be a keep ratio like 0.2 or a token count like 512, "
                         f"got {value!r}") from None
