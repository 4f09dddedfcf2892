"""Kernel tests run the Triton kernels under the CPU interpreter when there is no GPU.

``TRITON_INTERPRET`` is set per test (``monkeypatch``), not process-wide: other test
directories share the pytest process, and ``backend="auto"`` reads the variable at launch
time, so a global setting would route their CPU calls through the (slow) interpreter.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _triton_interpreter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
