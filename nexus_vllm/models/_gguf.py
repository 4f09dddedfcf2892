"""The GGUF -> Hugging Face checkpoint steps every prepared model shares.

A model's ``build`` loads its GGUF file with transformers (model and tokenizer, with the
model's own repairs), then :func:`plain_model` rebuilds the model without the
quantization config, which blocks ``save_pretrained`` and would make vLLM look for a GGUF
file, and :func:`save_checkpoint` writes the float32 checkpoint and its tokenizer.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["plain_model", "save_checkpoint"]

# Keys of the GGUF-loaded config that are not the model's: its quantization, where it was
# read from, and what the rebuilt config sets itself.
_DROPPED = ("quantization_config", "_name_or_path", "_model_name_or_path", "architectures",
            "transformers_version")


def plain_model(gguf_model: PreTrainedModel, config_cls: type[PretrainedConfig],
                model_cls: type[PreTrainedModel],
                special_ids: Mapping[str, int | list[int]],
                check: Callable[[PretrainedConfig], None] | None = None) -> PreTrainedModel:
    """``gguf_model`` (a causal LM transformers loaded from a GGUF file) rebuilt as a plain
    float32 ``model_cls`` with a ``config_cls`` config, its weights copied.

    Parameters
    ----------
    special_ids : mapping
        ``bos_token_id``, ``eos_token_id``, ``pad_token_id``: set on the config.
    check : callable, optional
        Raises on a config that is not the expected model's (run before building it).

    Raises
    ------
    RuntimeError
        When the weights do not match the rebuilt model's (a tied ``lm_head.weight``
        aside).
    """
    cfg = gguf_model.config.to_dict()
    for key in _DROPPED:
        cfg.pop(key, None)
    cfg.update(special_ids, dtype="float32")
    config = config_cls(**cfg)
    config.architectures = [model_cls.__name__]
    if check is not None:
        check(config)
    model = model_cls(config).float()
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings legitimately lack lm_head.weight in the GGUF state dict.
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    return model


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                    out: pathlib.Path,
                    special_ids: Mapping[str, int | list[int]],
                    tokenizer_config: Mapping[str, object]) -> None:
    """Write ``model`` (safetensors, with a greedy generation config of ``special_ids``)
    and ``tokenizer`` to ``out``; ``tokenizer_config.json`` gets ``tokenizer_config``'s
    entries (a tokenizer class every supported transformers version loads, flags) and the
    model's context length, without the keys transformers writes about where it read the
    tokenizer from."""
    from transformers import GenerationConfig

    # No sampling defaults: vLLM applies a generation config's top_k/top_p to every request.
    model.generation_config = GenerationConfig(**special_ids, do_sample=False)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    path = out / "tokenizer_config.json"
    tok_cfg = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        tok_cfg.pop(key, None)
    tok_cfg.update(tokenizer_config)
    tok_cfg["model_max_length"] = int(model.config.max_position_embeddings)
    path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
