"""What sizing needs of a model: its attention shape, which layers slide, dtype and weight
bytes, from a built-in name or an HF ``config.json`` (:func:`model_shape`).

Which layers use a sliding window follows what transformers builds from ``config.json``
(vLLM reads ``sliding_window`` and ``layer_types`` from that config): ``layer_types``
when listed; else every ``sliding_window_pattern``-th layer is full (Gemma 3 defaults to
6, Gemma 2 and gpt-oss to 2); else, for Qwen2/Qwen3 with ``use_sliding_window``, the
layers from ``max_window_layers`` on slide; else every layer slides (Mistral). No
``sliding_window``, or ``use_sliding_window`` false: no layer slides.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

from nexus_vllm.core import ConfigError

__all__ = ["BUILTIN_CONFIGS", "BUILTIN_MODELS", "DTYPE_BYTES", "LAYER_TYPES",
           "MODEL_TYPE_DEFAULTS", "ModelShape", "model_shape", "param_count", "sliding_layers"]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "fp8": 1,
               "float8_e4m3fn": 1, "float8_e5m2": 1}

# Published config.json fields; weights are computed from them (:func:`param_count`):
# 8.03e9, 70.55e9 and 72.71e9 parameters at 2 bytes; the Gemma 3 models' 0.27e9 and, for
# gemma-3-27b, the 27.01e9 of its language model (the text_config of google/gemma-3-27b-it;
# the checkpoint's vision tower is not counted).
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
    "gemma-3-270m": {"num_hidden_layers": 18, "num_attention_heads": 4,
                     "num_key_value_heads": 1, "hidden_size": 640, "head_dim": 256,
                     "intermediate_size": 2048, "vocab_size": 262144,
                     "tie_word_embeddings": True, "torch_dtype": "bfloat16",
                     "sliding_window": 512, "sliding_window_pattern": 6,
                     "model_type": "gemma3_text"},
    "gemma-3-27b": {"num_hidden_layers": 62, "num_attention_heads": 32,
                    "num_key_value_heads": 16, "hidden_size": 5376, "head_dim": 128,
                    "intermediate_size": 21504, "vocab_size": 262208,
                    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
                    "sliding_window": 1024, "sliding_window_pattern": 6,
                    "model_type": "gemma3_text"},
}

# transformers' config defaults (its configuration_*.py) for the fields read here, where a
# config.json may leave them out: Gemma 3's text_config often lists only what differs.
MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"num_hidden_layers": 26, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "hidden_size": 2304, "head_dim": 256,
                    "intermediate_size": 9216, "vocab_size": 262208,
                    "tie_word_embeddings": True, "sliding_window": 4096,
                    "sliding_window_pattern": 6},
    "gemma2": {"sliding_window": 4096, "sliding_window_pattern": 2,
               "tie_word_embeddings": True},
    "gpt_oss": {"sliding_window": 128, "sliding_window_pattern": 2},
    "mistral": {"sliding_window": 4096},
    "qwen2": {"use_sliding_window": False, "max_window_layers": 28},
    "qwen3": {"use_sliding_window": False, "max_window_layers": 28},
}
LAYER_TYPES = ("full_attention", "sliding_attention")


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
    sliding_window : int or None
        Tokens a sliding-window layer attends to (None: no layer slides).
    sliding_layers : tuple of int
        Indices of the sliding-window layers, ascending (the others attend to every
        token); empty exactly when ``sliding_window`` is None.
    """

    name: str
    layers: int
    attention_heads: int
    kv_heads: int
    head_size: int
    dtype: str
    weight_bytes: int
    weight_source: str
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("layers", "attention_heads", "kv_heads", "head_size", "weight_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(name, f"{name} must be a positive int; got "
                                        f"{getattr(self, name)!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError("dtype", f"dtype must be one of {sorted(DTYPE_BYTES)}; got "
                                       f"{self.dtype!r}")
        window, sliding = self.sliding_window, tuple(self.sliding_layers)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ConfigError("sliding_window", "sliding_window must be a positive int or "
                                                f"None; got {window!r}")
        if (window is None) != (not sliding):
            raise ConfigError("sliding_layers", "sliding_layers must be given exactly when "
                                                f"sliding_window is; got {window!r} and "
                                                f"{len(sliding)} sliding layers")
        if any(not isinstance(i, int) for i in sliding) \
                or list(sliding) != sorted(set(sliding)) \
                or (sliding and not 0 <= sliding[0] <= sliding[-1] < self.layers):
            raise ConfigError("sliding_layers", "sliding_layers must be distinct ascending "
                                                f"layer indices in [0, {self.layers})")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers, ascending."""
        sliding = set(self.sliding_layers)
        return tuple(i for i in range(self.layers) if i not in sliding)


def param_count(config: dict[str, Any]) -> int:
    """Parameters of a Llama/Qwen2/Gemma-style decoder from its config: embeddings, per
    layer Q/K/V/O (with Q/K/V biases for ``qwen2``), a gated MLP and two norms (four for
    Gemma 2 and 3, plus Gemma 3's Q and K norms), the final norm, and an LM head unless
    tied."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    bias = config.get("attention_bias", config.get("model_type") == "qwen2")
    attn = hidden * heads * head * 2 + hidden * kv_heads * head * 2
    if bias:
        attn += heads * head + 2 * kv_heads * head
    model_type = config.get("model_type")
    norms = 4 * hidden if model_type in ("gemma2", "gemma3_text") else 2 * hidden
    if model_type == "gemma3_text":
        norms += 2 * head
    layer = attn + 3 * hidden * inter + norms
    head_params = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + int(config["num_hidden_layers"]) * layer + hidden + head_params


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's fields: a multimodal config's ``text_config`` (with the top level's
    dtype), over transformers' defaults for its ``model_type``."""
    text = config.get("text_config")
    if isinstance(text, dict):
        top_type = str(config.get("model_type") or "")
        merged = dict(text)
        merged.setdefault("model_type", {"gemma3": "gemma3_text"}.get(top_type, top_type))
        for key in ("torch_dtype", "dtype"):
            if key in config:
                merged.setdefault(key, config[key])
        config = merged
    return {**MODEL_TYPE_DEFAULTS.get(str(config.get("model_type")), {}), **config}


def sliding_layers(config: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """``(sliding_window, indices of the sliding-window layers)`` of a decoder's config
    (``(None, ())``: every layer attends to every token), as transformers builds
    ``layer_types`` (the module docstring has the rule).

    Raises
    ------
    ConfigError
        Naming ``model`` when ``layer_types`` has the wrong length or a kind other than
        full or sliding-window attention.
    """
    layers = int(config["num_hidden_layers"])
    kinds = config.get("layer_types")
    if kinds is not None:
        if len(kinds) != layers:
            raise ConfigError("model", f"layer_types lists {len(kinds)} layers, "
                                       f"num_hidden_layers is {layers}")
        other = sorted(set(kinds) - set(LAYER_TYPES))
        if other:
            raise ConfigError("model", f"layer_types {other}: only full_attention and "
                                       "sliding_attention layers are sized")
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window", True) is False:
        return None, ()
    window = int(window)
    if kinds is not None:
        sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    elif config.get("sliding_window_pattern"):
        pattern = int(config["sliding_window_pattern"])
        sliding = [i for i in range(layers) if (i + 1) % pattern]
    elif config.get("use_sliding_window") and config.get("max_window_layers") is not None:
        sliding = list(range(int(config["max_window_layers"]), layers))
    else:
        sliding = list(range(layers))
    return (window, tuple(sliding)) if sliding else (None, ())


def _shape_from_config(name: str, config: dict[str, Any],
                       index: dict[str, Any] | None) -> ModelShape:
    config = _text_config(config)
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
    window, sliding = sliding_layers(config)
    return ModelShape(
        name=name, layers=int(config["num_hidden_layers"]), attention_heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_size=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        dtype=dtype, weight_bytes=weight_bytes, weight_source=source,
        sliding_window=window, sliding_layers=sliding)


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

