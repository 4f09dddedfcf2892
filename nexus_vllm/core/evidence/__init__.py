"""Evidence kinds, one module each, in a registry (see :mod:`.base`).

Importing this package registers the built-in kinds: ``mass`` (the window's attention)
and ``key_norms``.
"""

from . import key_norms, mass  # noqa: F401  (registers the kinds)
from .base import (
    EVIDENCE_KINDS,
    DenseLayer,
    DenseSequence,
    Evidence,
    EvidenceKind,
    PagedBatch,
    evidence_kind,
    register_evidence,
)

__all__ = [
    "EVIDENCE_KINDS",
    "DenseLayer",
    "DenseSequence",
    "Evidence",
    "EvidenceKind",
    "PagedBatch",
    "evidence_kind",
    "register_evidence",
]
