"""Compiled-mode build of every kernel for sm_90, on CPU (the interpreter cannot catch these).

A global that is not ``tl.constexpr``, for instance, runs fine under ``TRITON_INTERPRET=1``
and fails only when compiled; this builds each kernel through the real compiler pipeline.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from nexus_vllm.kernels import HAS_TRITON
from tests.script_module import load_script


def _load() -> ModuleType:
    return load_script("benchmarks/kernels/aot_compile_check.py")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernels_compile_for_sm90(monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning
    aot = _load()
    if aot._ptxas() is None:
        pytest.skip("this triton build has no bundled ptxas")
    shapes = [
        ("bf16-w16-gqa4", torch.bfloat16, 16, 32, 8, 128, 16),
        ("fp32-w3-g3-d40-b64", torch.float32, 3, 6, 2, 40, 64),
    ]
    builds = aot.compile_all(90, verbose=False, shapes=shapes)
    kinds = {b.kernel for b in builds}
    assert {"partial", "factor", "combine(acc=False)", "combine(acc=True)",
            "combine(acc=False, max)", "combine(acc=True, max)", "compact"} <= kinds
    assert all(b.shared_bytes <= 228 * 1024 for b in builds)  # fits an H100/H200 SM
