"""Tiny offline stand-ins for tests: a random Llama and a byte-level tokenizer.

Nothing is downloaded; both build in well under a second.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FAMILIES", "byte_tokenizer", "tiny_llama", "tiny_model"]

_EOS = "<|eos|>"


def byte_tokenizer() -> Any:
    """A byte-level BPE tokenizer without merges (one token per byte) plus an eos token.

    Returns a ``PreTrainedTokenizerFast`` (offsets and decode round-trip like a real
    byte-level tokenizer, e.g. SmolLM2's).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=_EOS, pad_token=_EOS)
    fast.add_special_tokens({"eos_token": _EOS})
    return fast


FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def tiny_model(family: str = "llama", vocab_size: int = 260, *, layers: int = 3, seed: int = 0,
               eos_token_id: int | None = None) -> Any:
    """A randomly initialised causal LM of ``family`` (hidden 64, 4 query / 2 KV heads, GQA).

    ``initializer_range`` is large so that logits are well separated and greedy decoding is
    stable against float reordering between chunked and one-shot prefill.
    """
    import torch
    import transformers

    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}
    if family not in names:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    config_cls = getattr(transformers, f"{names[family]}Config")
    model_cls = getattr(transformers, f"{names[family]}ForCausalLM")
    torch.manual_seed(seed)
    cfg = config_cls(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
        initializer_range=0.2, eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False,
    )
    if hasattr(cfg, "sliding_window"):
        cfg.sliding_window = None  # full attention, like the released checkpoints we serve
    cfg._attn_implementation = "sdpa"
    model = model_cls(cfg).eval()
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = eos_token_id
    return model


def tiny_llama(vocab_size: int = 260, *, layers: int = 3, seed: int = 0,
               eos_token_id: int | None = None) -> Any:
    """``tiny_model("llama", ...)``."""
    return tiny_model("llama", vocab_size, layers=layers, seed=seed, eos_token_id=eos_token_id)
