"""Tiny offline stand-ins for tests: random Llama-family models, tokenizers, checkpoints.

The one builder of test models for the whole suite:

- :func:`tiny_model` / :func:`tiny_llama`: an in-memory random causal LM;
- :func:`byte_tokenizer`: one token per byte plus an eos token;
- :func:`trained_tokenizer`: a small byte-level BPE trained on :data:`CORPUS`, with bos,
  eos and a chat template (what a served model needs);
- :func:`save_tiny_checkpoint`: a model and a tokenizer saved with ``save_pretrained``
  (float32, safetensors) for ``vllm serve``, ``nexus-vllm eval --model`` and friends.

Nothing is downloaded; everything builds in a second or two.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Literal, TypeVar

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = ["CORPUS", "FAMILIES", "byte_tokenizer", "save_tiny_checkpoint", "tiny_llama",
           "tiny_model", "trained_tokenizer"]

_EOS = "<|eos|>"
_Model = TypeVar("_Model", bound="PreTrainedModel")
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "gpt_oss")
# The gemma3 and gpt_oss families' sliding window (tokens): short, so that test prompts
# outgrow it.
TINY_SLIDING_WINDOW = 64
# The gpt_oss family's experts (2 routed per token).
TINY_EXPERTS = 4
# Weight scale of every matrix (embeddings, projections, head). Ten times transformers'
# default, so attention is far from uniform, logits are well separated and greedy
# decoding is not decided by float reordering (chunked vs one-shot prefill, vLLM vs HF).
INIT_STD = 0.2
# The trained tokenizer's training text (tests that need in-vocabulary prose use it too).
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A budget for the key value cache keeps memory bounded while tokens stream.",
    "Blocks are scored by attention mass and sampled by weighted reservoir sampling.",
    "Once upon a time there was a little model that could count to one hundred.",
    "one two three four five six seven eight nine ten eleven twelve thirteen",
    "Paris is the capital of France. Berlin is the capital of Germany.",
]


def byte_tokenizer() -> PreTrainedTokenizerFast:
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


def trained_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on :data:`CORPUS` (``<s>`` bos id 0, ``</s>`` eos id 1)
    with a plain-text chat template. Returns a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return fast


def tiny_model(family: str = "llama", vocab_size: int = 260, *, layers: int = 3,
               heads: int = 4, kv_heads: int = 2, head_dim: int = 16, seed: int = 0,
               eos_token_id: int | None = None, bos_token_id: int | None = None
               ) -> PreTrainedModel:
    """A randomly initialised causal LM of ``family`` (hidden 64, intermediate 128).

    Parameters
    ----------
    family : {"llama", "qwen2", "qwen3", "mistral", "gemma3", "gpt_oss"}
        ``gemma3`` interleaves sliding-window layers (:data:`TINY_SLIDING_WINDOW`
        tokens) with full-attention ones, every second layer full, as Gemma 3 does
        every sixth; ``gpt_oss`` does the same (even layers sliding, as gpt-oss) and
        adds learned attention sinks (one logit per query head, drawn from
        N(0, 1): a real share of each row's mass) and a mixture of
        :data:`TINY_EXPERTS` experts (2 per token), unquantized; the others attend
        fully.
    vocab_size : int
        ``len(tokenizer)``.
    layers, heads, kv_heads, head_dim : int
        Depth and attention shape (default 4 query / 2 KV heads of 16: GQA). vLLM's
        attention kernels need a head size they support, e.g. 32
        (:func:`save_tiny_checkpoint`'s default).
    seed : int
        Seeds the weights: every matrix is drawn from N(0, ``INIT_STD``), norms are 1.
    eos_token_id, bos_token_id : int, optional
        Written to the config and the generation config.
    """
    import torch
    import transformers

    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
             "gemma3": "Gemma3Text", "gpt_oss": "GptOss"}
    if family not in names:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    config_cls = getattr(transformers, f"{names[family]}Config")
    model_cls = getattr(transformers, "Gemma3ForCausalLM" if family == "gemma3"
                        else f"{names[family]}ForCausalLM")
    torch.manual_seed(seed)
    extra: dict[str, object] = {}
    if family == "gemma3":
        extra = {"sliding_window": TINY_SLIDING_WINDOW, "query_pre_attn_scalar": head_dim,
                 "layer_types": ["full_attention" if i % 2 else "sliding_attention"
                                 for i in range(layers)]}
    elif family == "gpt_oss":
        # vLLM's gpt_oss.py makes every even layer sliding whatever layer_types says;
        # transformers' default layer_types agree (written out here all the same).
        extra = {"sliding_window": TINY_SLIDING_WINDOW, "num_local_experts": TINY_EXPERTS,
                 "num_experts_per_tok": 2,
                 # YaRN as gpt-oss, its factor the ratio transformers expects.
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0,
                                     "factor": 2.0, "original_max_position_embeddings": 4096,
                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
                 "layer_types": ["full_attention" if i % 2 else "sliding_attention"
                                 for i in range(layers)]}
    cfg = config_cls(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=8192, initializer_range=INIT_STD, eos_token_id=eos_token_id,
        bos_token_id=bos_token_id, pad_token_id=None, tie_word_embeddings=False, **extra,
    )
    if family not in ("gemma3", "gpt_oss") and hasattr(cfg, "sliding_window"):
        cfg.sliding_window = None  # full attention, like the released checkpoints we serve
    # gpt-oss's sinks need the eager attention (sdpa has no sink term).
    cfg._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"
    model = finish_tiny_model(model_cls(cfg), eos_token_id)
    if family == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


def finish_tiny_model(model: _Model, eos_token_id: int | None) -> _Model:
    """``model`` in eval mode with every matrix redrawn from ``N(0, INIT_STD)`` (the torch
    seed set by the caller) and its generation config's eos and pad set.

    Redrawn explicitly rather than trusting each family's ``_init_weights`` (and its
    version-to-version changes): the same seed gives the same weights everywhere."""
    import torch

    model = model.eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, INIT_STD)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = eos_token_id
    return model


def tiny_llama(vocab_size: int = 260, *, layers: int = 3, seed: int = 0,
               eos_token_id: int | None = None) -> PreTrainedModel:
    """``tiny_model("llama", ...)``."""
    return tiny_model("llama", vocab_size, layers=layers, seed=seed, eos_token_id=eos_token_id)


def save_tiny_checkpoint(out_dir: str | pathlib.Path, *,
                         tokenizer: Literal["trained", "byte"] = "trained",
                         family: str = "llama", layers: int = 4, heads: int = 2,
                         kv_heads: int = 1, head_dim: int = 32,
                         seed: int = 0) -> pathlib.Path:
    """Save a :func:`tiny_model` and its tokenizer to ``out_dir`` (created); return it.

    The defaults (4 layers, 2 query heads, 1 KV head of size 32, the trained tokenizer
    with a chat template) are a model ``vllm serve`` accepts on the CPU.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = trained_tokenizer() if tokenizer == "trained" else byte_tokenizer()
    tok.save_pretrained(out)
    model = tiny_model(family, len(tok), layers=layers, heads=heads, kv_heads=kv_heads,
                       head_dim=head_dim, seed=seed, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.bos_token_id)
    model.save_pretrained(out, safe_serialization=True)
    return out
