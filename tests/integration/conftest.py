"""Fixtures for the vLLM plugin tests: a tiny random Llama and shared server helpers."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from tests.integration.tiny_model import build_tiny_llama

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def serve_tmp(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("vllm_serve")
