"""The transformers-path tests' tiny random Llama and its byte tokenizer."""

from __future__ import annotations

import pytest

from nexus_vllm.hf.testing import byte_tokenizer, tiny_llama


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(vocab_size=len(tok), eos_token_id=tok.eos_token_id)
