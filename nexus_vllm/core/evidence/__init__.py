"""Evidence kinds, one module each, in a registry (see :mod:`.base`).

Importing this package registers the built-in kinds: ``mass`` (the window's attention),
``key_norms`` and ``expected_attention`` (query-agnostic).
"""

from . import expected_attention, key_norms, mass  # noqa: F401  (registers the kinds)
from .base import (
    EVIDENCE_KINDS,
    DenseLayer,
    DenseSequence,
    Evidence,
    EvidenceKind,
    PagedBatch,
    carried_kinds,
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
    "carried_kinds",
    "evidence_kind",
    "register_evidence",
]
