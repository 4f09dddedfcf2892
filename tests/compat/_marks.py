"""The marks every vLLM 0.34 compat module carries."""

from __future__ import annotations

import importlib.metadata

import pytest

from tests.integration.conftest import HAS_VLLM


def is_034() -> bool:
    """Whether this interpreter's vLLM is 0.34 (the build of scripts/setup_vllm034.sh)."""
    return HAS_VLLM and importlib.metadata.version("vllm").startswith("0.34.")


VLLM034 = [
    pytest.mark.e2e, pytest.mark.slow, pytest.mark.compat,
    pytest.mark.skipif(not is_034(), reason="needs the vLLM 0.34 build "
                       "(bash scripts/test_vllm034.sh)"),
]
