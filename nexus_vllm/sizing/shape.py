"""What sizing needs of a model: its attention shape, dtype and weight bytes, from a
built-in name or an HF ``config.json`` (:func:`model_shape`)."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

from nexus_vllm.core import ConfigError

__all__ = ["BUILTIN_CONFIGS", "BUILTIN_MODELS", "DTYPE_BYTES", "ModelShape", "model_shape",
           "param_count"]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "fp8": 1,
               "float8_e4m3fn": 1, "float8_e5m2": 1}

# Published config.json fields; weights are computed from them (:func:`param_count`):
# 8.03e9, 70.55e9 and 72.71e9 parameters at 2 bytes.
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {"num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
                     "intermediate_size": 14336, "vocab_size": 128256,
                     "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                     "model_type": "llama"},
    "llama-3.1-70b": {"num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "hidden_size": 8192, "head_dim": 128,
                      "intermediate_size": 28672, "vocab_size": 128256,
                      "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                      "model_type": "llama"},
    "qwen2.5-72b": {"num_hidden_layers": 80, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "hidden_size": 8192,
                    "intermediate_size": 29568, "vocab_size": 152064,
                    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                    "model_type": "qwen2"},
}


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs of a model.

    Parameters
    ----------
    name : str
        Built-in name or the config's path.
    layers, attention_heads, kv_heads, head_size : int
        Attention shape (``kv_heads`` < ``attention_heads`` with GQA).
    dtype : str
        KV and weight dtype (a key of ``DTYPE_BYTES``).
    weight_bytes : int
        Bytes of all the weights.
    weight_source : str
        Where ``weight_bytes`` comes from (the safetensors index, or estimated from the
        parameter count the config implies).
    """

    name: str
    layers: int
    attention_heads: int
    kv_heads: int
    head_size: int
    dtype: str
    weight_bytes: int
    weight_source: str

    def __post_init__(self) -> None:
        for name in ("layers", "attention_heads", "kv_heads", "head_size", "weight_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(name, f"{name} must be a positive int; got "
                                        f"{getattr(self, name)!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError("dtype", f"dtype must be one of {sorted(DTYPE_BYTES)}; got "
                                       f"{self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


def param_count(config: dict[str, Any]) -> int:
    """Parameters of a Llama/Qwen2-style decoder from its config: embeddings, per layer
    Q/K/V/O (with Q/K/V biases for ``qwen2``), a gated MLP and two norms, the final norm,
    and an LM head unless tied."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    bias = config.get("attention_bias", config.get("model_type") == "qwen2")
    attn = hidden * heads * head * 2 + hidden * kv_heads * head * 2
    if bias:
        attn += heads * head + 2 * kv_heads * head
    layer = attn + 3 * hidden * inter + 2 * hidden
    head_params = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + int(config["num_hidden_layers"]) * layer + hidden + head_params


def _shape_from_config(name: str, config: dict[str, Any],
                       index: dict[str, Any] | None) -> ModelShape:
    heads = int(config["num_attention_heads"])
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    dtype = dtype.removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ConfigError("dtype", f"torch_dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    total = (index or {}).get("metadata", {}).get("total_size")
    if total:
        weight_bytes, source = int(total), "model.safetensors.index.json metadata.total_size"
    else:
        params = param_count(config)
        weight_bytes = params * DTYPE_BYTES[dtype]
        source = f"estimated: {params / 1e9:.2f}e9 parameters from the config x {dtype}"
    return ModelShape(
        name=name, layers=int(config["num_hidden_layers"]), attention_heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_size=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        dtype=dtype, weight_bytes=weight_bytes, weight_source=source)


BUILTIN_MODELS: dict[str, ModelShape] = {
    name: _shape_from_config(name, cfg, None) for name, cfg in BUILTIN_CONFIGS.items()}


def model_shape(spec: str) -> ModelShape:
    """A built-in name, or an HF ``config.json`` (the file or its directory; the
    directory's ``model.safetensors.index.json`` gives the weight bytes when present).

    Raises
    ------
    ConfigError
        Naming ``model`` when ``spec`` is neither, or the config lacks a field.
    """
    if spec.lower() in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec.lower()]
    path = pathlib.Path(spec)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise ConfigError("model", f"{spec!r} is neither a built-in model "
                                   f"({', '.join(BUILTIN_MODELS)}) nor a config.json or a "
                                   "directory holding one")
    try:
        config = json.loads(config_path.read_text())
        index_path = config_path.parent / "model.safetensors.index.json"
        index = json.loads(index_path.read_text()) if index_path.is_file() else None
        return _shape_from_config(str(spec), config, index)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ConfigError("model", f"{config_path}: {what}") from None

