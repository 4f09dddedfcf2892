"""Startup failures of a real ``vllm serve`` with bad plugin flags (~10 s each)."""

from __future__ import annotations

import subprocess

import pytest

from tests.integration.conftest import HAS_VLLM

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]


@pytest.mark.parametrize("argv, flag", [
    (["--kv-eviction", "lru", "--kv-budget", "1024"], "--kv-eviction"),
    (["--kv-eviction", "nexus"], "--kv-budget"),
    (["--kv-eviction", "nexus", "--kv-budget", "1024",
      "--additional-config", '{"nexus": {"widow": 3}}'], "--additional-config"),
    (["--kv-eviction", "nexus", "--kv-budget", "1024", "--kv-prompt-mode", "stream",
      "--additional-config", '{"nexus": {"expected": 2}}'], "--additional-config"),
])
def test_bad_flags_stop_startup(tiny_model, serve_tmp, argv, flag) -> None:  # noqa: ANN001
    from nexus_vllm.eval.server import server_env, vllm_cmd

    out = subprocess.run(vllm_cmd(tiny_model, "--port", "1", *argv), capture_output=True,
                         text=True, timeout=180, env=server_env(serve_tmp))
    assert out.returncode != 0
    tail = (out.stderr + out.stdout)[-3000:]
    assert flag in tail, tail
    assert "Traceback" not in tail, tail
