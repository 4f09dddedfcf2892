"""What the typed launchers (``_scoring_ops.py``, ``_compaction_ops.py``) share.

``HAS_TRITON`` says whether triton imports here; ``resolve_backend`` maps the ``backend``
argument of every public op to the path that runs (see ``ops.py`` for the rules). Also the
dtypes the launchers accept and the argument checks both families make. Importing this
module imports triton only to test for it.
"""

from __future__ import annotations

import torch

from nexus_vllm.kernels._interpreter import triton_interpret_enabled

try:  # import guard: the package must import without triton (CPU-only installs)
    import triton  # noqa: F401

    HAS_TRITON = True
except (ImportError, OSError):  # pragma: no cover - missing or broken (no libtriton) install
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "torch", "batched")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int32, torch.int64)


def check_backend(backend: str) -> None:
    """Raise ``ValueError`` unless ``backend`` is one of ``BACKENDS``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_same_device(
    anchor_name: str, anchor: torch.Tensor, *others: tuple[str, torch.Tensor]
) -> None:
    """Raise ``ValueError`` naming the first of ``others`` (``(name, tensor)`` pairs) that
    is not on ``anchor``'s device."""
    for name, t in others:
        if t.device != anchor.device:
            raise ValueError(f"{name} is on {t.device} but {anchor_name} on {anchor.device}")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``backend`` (one of ``BACKENDS``) to the path that runs: ``"triton"``, ``"torch"``
    or ``"batched"`` (``"auto"`` picks as the ``ops`` module docstring says)."""
    check_backend(backend)
    if backend in ("torch", "batched"):
        return backend
    can_triton = HAS_TRITON and (device.type == "cuda" or triton_interpret_enabled())
    if backend == "triton":
        if not can_triton:
            raise ValueError(
                "backend='triton' needs triton and either CUDA tensors or TRITON_INTERPRET=1 "
                f"(triton installed: {HAS_TRITON}, device: {device})"
            )
        return "triton"
    return "triton" if can_triton else "torch"
