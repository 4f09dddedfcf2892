"""Test-only fault injection: ``NEXUS_VLLM_FAULTS``.

The reliability tests start real servers with faults switched on to show that eviction
fails closed (nothing freed that a worker may still read, no deadlock across tensor-
parallel ranks, the server keeps serving). The production classes never ask: when the
variable names a fault, the scheduler or the worker is built with a test double of the
part that fails (:func:`with_doubles`; the doubles live in ``integration/testing/``,
which no production module imports: :data:`DOUBLES` names them, and a double's module is
imported only when its fault is named), and only the double calls :func:`fires`. Unset,
no double is built. (:class:`FaultLog`, which
counts the faults a server absorbs, real or injected, is production code.)

Format: a comma-separated list of ``KIND[@RANK][/EVERY]``:

* ``KIND``: ``score_error`` (the worker's scoring raises), ``policy_error`` (the
  scheduler's policy raises), ``plan_lost`` (the worker ignores the step's plan),
  ``plan_duplicate`` (the scheduler sends the previous plan again instead of the new one);
* ``@RANK``: only on that tensor-parallel rank (worker faults);
* ``/EVERY``: fire on every ``EVERY``-th opportunity (default: every one).

Example: ``NEXUS_VLLM_FAULTS=score_error@1`` makes rank 1 fail every scoring step.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["DOUBLES", "ENV", "KINDS", "FaultLog", "FaultSpec", "fires", "parse",
           "with_doubles"]

Parts = TypeVar("Parts")

ENV = "NEXUS_VLLM_FAULTS"
_TESTING = "nexus_vllm.integration.testing"
# Each fault's double: the part it stands in for (a field of the scheduler's
# ``SchedulerParts`` or the worker's ``WorkerParts``) and the double's class, by name.
DOUBLES: Mapping[str, tuple[str, str]] = {
    "score_error": ("scorer", f"{_TESTING}.worker_doubles.FailingScorer"),
    "policy_error": ("evictor", f"{_TESTING}.scheduler_doubles.FailingEvictor"),
    "plan_lost": ("plan_check", f"{_TESTING}.worker_doubles.LosingPlanCheck"),
    "plan_duplicate": ("sender", f"{_TESTING}.scheduler_doubles.DuplicatingSender"),
}
KINDS = tuple(DOUBLES)


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    rank: int | None = None
    every: int = 1


def parse(text: str) -> dict[str, FaultSpec]:
    """Parse a ``NEXUS_VLLM_FAULTS`` value (raises ``ValueError`` naming the bad part)."""
    specs: dict[str, FaultSpec] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        body, _, every = part.partition("/")
        kind, _, rank = body.partition("@")
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault {kind!r}; choose from {', '.join(KINDS)}")
        try:
            spec = FaultSpec(kind, int(rank) if rank else None, int(every) if every else 1)
        except ValueError:
            raise ValueError(f"{ENV}: cannot parse {part!r} (KIND[@RANK][/EVERY])") from None
        if spec.every < 1:
            raise ValueError(f"{ENV}: EVERY must be >= 1 in {part!r}")
        specs[kind] = spec
    return specs


_SPECS: dict[str, FaultSpec] | None = None
_SEEN: Counter[str] = Counter()


def fires(kind: str, *, rank: int | None = None) -> bool:
    """Whether the injected fault ``kind`` fires at this opportunity."""
    global _SPECS
    if _SPECS is None:
        _SPECS = parse(os.environ.get(ENV, ""))
    spec = _SPECS.get(kind)
    if spec is None or (spec.rank is not None and rank is not None and spec.rank != rank):
        return False
    _SEEN[kind] += 1
    return _SEEN[kind] % spec.every == 0


def with_doubles(parts: Parts) -> Parts:
    """``parts`` (a frozen dataclass of part factories: ``SchedulerParts``,
    ``WorkerParts``) with, for each fault kind ``NEXUS_VLLM_FAULTS`` names whose part is
    one of its fields, that part replaced by the double (:data:`DOUBLES`), built with
    ``fires`` bound to that kind (``fires(rank=...)`` for a per-rank fault). Unset, or
    naming none of ``parts``' faults, ``parts`` unchanged and no double imported."""
    specs = parse(os.environ.get(ENV, ""))
    fields = {f.name for f in dataclasses.fields(parts)}  # type: ignore[arg-type]
    for kind, (name, where) in DOUBLES.items():
        if kind in specs and name in fields:
            module, _, cls = where.rpartition(".")
            double: Callable[..., Any] = getattr(importlib.import_module(module), cls)
            parts = dataclasses.replace(  # type: ignore[type-var]
                parts, **{name: functools.partial(double, fires=functools.partial(fires, kind))})
    return parts


class FaultLog:
    """Faults absorbed without harm: counted per kind (into ``counts``, which the owner
    reports and clears), each kind logged the first time it is seen in this process.
    Thread-safe: under async scheduling a step's reply is built in vLLM's output thread."""

    def __init__(self, logger: logging.Logger, counts: Counter[str] | None = None) -> None:
        self.counts: Counter[str] = Counter() if counts is None else counts
        self._logger = logger
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, kind: str, message: str, *, exc: bool = False,
                 count: bool = True) -> None:
        """Count (unless ``count`` is False: the caller reports it itself) and log once."""
        with self._lock:
            if count:
                self.counts[kind] += 1
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            log = self._logger.exception if exc else self._logger.warning
            log("nexus-vllm: %s (%s; logged once per kind, counted in "
                "vllm:nexus_faults_total)", message, kind)

    def take(self) -> dict[str, int]:
        """The counts since the last call."""
        with self._lock:
            out = dict(self.counts)
            self.counts.clear()
        return out
