"""What sizing needs of a model: its attention shape, which layers slide, dtype and weight
bytes, from a built-in name or an HF ``config.json`` (:func:`model_shape`).

Which layers use a sliding window follows what transformers builds from ``config.json``
(vLLM reads ``sliding_window`` and ``layer_types`` from that config): ``layer_types``
when listed; else every ``sliding_window_pattern``-th layer is full (Gemma 3 defaults to
6, Gemma 2 and gpt-oss to 2); else, for Qwen2/Qwen3 with ``use_sliding_window``, the
layers from ``max_window_layers`` on slide; else every layer slides (Mistral). No
``sliding_window``, or ``use_sliding_window`` false: no layer slides.

A multi-head latent attention (MLA) model (DeepSeek-V2/V3: ``kv_lora_rank`` in its
config) caches one latent row per token per layer, ``kv_lora_rank + qk_rope_head_dim``
wide (576 for DeepSeek-V2 and V3): K only, no separate V, and the same on every TP rank
(vLLM's ``MLAAttentionSpec``: one KV head, ``max_tp_shards=1``). Its weights are counted
for DeepSeek's layout (:func:`mla_param_count`); the multi-token-prediction layers are not
(vLLM loads them only for speculative decoding). Sparse MLA (DeepSeek-V3.2's index) is
refused.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

from nexus_vllm.core import ConfigError

__all__ = ["BUILTIN_CONFIGS", "BUILTIN_MODELS", "DTYPE_BYTES", "LAYER_TYPES",
           "MODEL_TYPE_DEFAULTS", "ModelShape", "mla_param_count", "model_shape", "param_count",
           "sliding_layers"]

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
    # MLA (the config.json of deepseek-ai/DeepSeek-V2-Lite and of DeepSeek-V3, the fields
    # read here): 15.71e9 and 671.03e9 parameters; DeepSeek-V3's checkpoint is fp8 (its
    # layers' linear weights, 128 x 128 blocks with a float32 scale each).
    "deepseek-v2-lite": {"num_hidden_layers": 27, "num_attention_heads": 16,
                         "num_key_value_heads": 16, "hidden_size": 2048,
                         "intermediate_size": 10944, "moe_intermediate_size": 1408,
                         "n_routed_experts": 64, "n_shared_experts": 2,
                         "first_k_dense_replace": 1, "moe_layer_freq": 1,
                         "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
                         "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
                         "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                         "model_type": "deepseek_v2"},
    "deepseek-v3": {"num_hidden_layers": 61, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "hidden_size": 7168,
                    "intermediate_size": 18432, "moe_intermediate_size": 2048,
                    "n_routed_experts": 256, "n_shared_experts": 1,
                    "first_k_dense_replace": 3, "moe_layer_freq": 1,
                    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
                    "num_nextn_predict_layers": 1, "topk_method": "noaux_tc",
                    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                    "quantization_config": {"quant_method": "fp8",
                                            "weight_block_size": [128, 128]},
                    "model_type": "deepseek_v3"},
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
    mla : bool
        Multi-head latent attention: each layer caches one latent row of ``head_size``
        (``kv_lora_rank + qk_rope_head_dim``) per token, K only, on every TP rank whole;
        ``kv_heads`` is 1 (vLLM's ``MLAAttentionSpec``).
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
    mla: bool = False

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
        if self.mla and (self.kv_heads != 1 or window is not None):
            raise ConfigError("kv_heads", "an MLA model caches one latent row per token "
                                          "(kv_heads 1) and has no sliding-window layer")

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


def _mla_matrices(config: dict[str, Any]) -> tuple[list[tuple[int, int, int]], int]:
    """DeepSeek-V2/V3's decoder (``modeling_deepseek.py``): ``([(rows, columns, count)]
    of the layers' linear weights, the other parameters)``. Per layer: the query
    projection (``q_proj``, or ``q_a_proj`` then ``q_b_proj`` with ``q_lora_rank``),
    ``kv_a_proj_with_mqa`` (to the latent and the rotary key), ``kv_b_proj`` (latent to
    keys without rotary and values), ``o_proj``; a gated MLP in the first
    ``first_k_dense_replace`` layers, then (every ``moe_layer_freq``-th) routed and
    shared experts of ``moe_intermediate_size``. Besides: embeddings, LM head, norms, the
    router (and its bias with ``noaux_tc`` routing)."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    layers = int(config["num_hidden_layers"])
    rank, rope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])
    nope, v = int(config["qk_nope_head_dim"]), int(config["v_head_dim"])
    q_rank = config.get("q_lora_rank")
    qk = heads * (nope + rope)
    mats = [(q_rank, hidden, layers), (qk, q_rank, layers)] if q_rank else [(qk, hidden, layers)]
    mats += [(rank + rope, hidden, layers), (heads * (nope + v), rank, layers),
             (hidden, heads * v, layers)]
    other = layers * (2 * hidden + rank + (q_rank or 0))  # norms
    first, freq = int(config.get("first_k_dense_replace", 0)), int(config.get(
        "moe_layer_freq", 1))
    experts = int(config.get("n_routed_experts") or 0)
    moe = sum(1 for i in range(first, layers) if i % freq == 0) if experts else 0
    mats += [(int(config["intermediate_size"]), hidden, 2 * (layers - moe)),
             (hidden, int(config["intermediate_size"]), layers - moe)]
    if moe:
        inter = int(config["moe_intermediate_size"])
        per_layer = experts + int(config.get("n_shared_experts") or 0)
        mats += [(inter, hidden, 2 * per_layer * moe), (hidden, inter, per_layer * moe)]
        other += moe * experts * (hidden + (config.get("topk_method") == "noaux_tc"))
    vocab = int(config["vocab_size"])
    tied = config.get("tie_word_embeddings", False)
    other += vocab * hidden * (1 if tied else 2) + hidden
    return mats, other


def mla_param_count(config: dict[str, Any]) -> int:
    """Parameters of a DeepSeek-V2/V3 decoder from its config (:func:`_mla_matrices`; no
    multi-token-prediction layer)."""
    mats, other = _mla_matrices(config)
    return sum(r * c * n for r, c, n in mats) + other


def _mla_weight_bytes(config: dict[str, Any], dtype: str) -> tuple[int, str]:
    """Bytes of an MLA model's weights and how they were counted: with an fp8
    ``quantization_config`` (DeepSeek-V3's checkpoint) the layers' linear weights take a
    byte each plus a float32 scale per ``weight_block_size`` block, the rest ``dtype``."""
    mats, other = _mla_matrices(config)
    params = sum(r * c * n for r, c, n in mats) + other
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return params * DTYPE_BYTES[dtype], (f"estimated: {params / 1e9:.2f}e9 parameters "
                                             f"from the config x {dtype}")
    br, bc = (int(x) for x in quant.get("weight_block_size") or (128, 128))
    linear = sum(r * c * n for r, c, n in mats)
    scales = sum(-(-r // br) * -(-c // bc) * n for r, c, n in mats)
    return (linear + 4 * scales + other * DTYPE_BYTES[dtype],
            f"estimated: {params / 1e9:.2f}e9 parameters from the config, the layers' "
            f"linear weights in fp8 (its quantization_config), the rest {dtype}")


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
    mla = config.get("kv_lora_rank") is not None
    if mla and config.get("index_topk") is not None:
        raise ConfigError("model", "sparse MLA (DeepSeek-V3.2's index, index_topk) is not "
                                   "sized: the plugin refuses it")
    total = (index or {}).get("metadata", {}).get("total_size")
    if total:
        weight_bytes, source = int(total), "model.safetensors.index.json metadata.total_size"
    elif mla:
        weight_bytes, source = _mla_weight_bytes(config, dtype)
    else:
        params = param_count(config)
        weight_bytes = params * DTYPE_BYTES[dtype]
        source = f"estimated: {params / 1e9:.2f}e9 parameters from the config x {dtype}"
    if mla:
        return ModelShape(
            name=name, layers=int(config["num_hidden_layers"]), attention_heads=heads,
            kv_heads=1, head_size=int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"]),
            dtype=dtype, weight_bytes=weight_bytes, weight_source=source, mla=True)
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

