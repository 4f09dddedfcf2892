"""Admission arithmetic: the one rule the plugin's scheduler and the capacity planner run.

An evicting request is admitted when the pool's free blocks, less what every admitted
evicting request may still grow to, cover its bound (:func:`~nexus_vllm.core.budget.bound_blocks`).
What an admitted request may still grow to is its :func:`~nexus_vllm.core.budget.peak_from` its
progress, less what it already holds: a request past its prompt reserves only its decode
peak. ``integration/scheduler/admission.py`` applies it to vLLM's pool;
``nexus_vllm.sizing.burst`` to a simulated burst.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["admission_room", "admits"]


def admission_room(free_blocks: int, admitted: Iterable[tuple[int, int]]) -> int:
    """Blocks a new request may count on.

    Parameters
    ----------
    free_blocks : int
        The pool's free blocks now.
    admitted : iterable of (int, int)
        ``(peak, held)`` of each admitted evicting request: the most blocks it may still
        come to hold (:func:`~nexus_vllm.core.budget.peak_from`) and the blocks it holds now.
    """
    return int(free_blocks) - sum(max(0, int(peak) - int(held)) for peak, held in admitted)


def admits(need: int, free_blocks: int, admitted: Iterable[tuple[int, int]]) -> bool:
    """Whether a request whose bound is ``need`` blocks may start
    (:func:`admission_room` covers it)."""
    return admission_room(free_blocks, admitted) >= int(need)
