"""A tiny random-weight Llama checkpoint with an offline-trained tokenizer (test plumbing).

Built in a second or two, no network: a byte-level BPE tokenizer trained on a few
sentences and a 4-layer Llama (hidden 64, 2 query heads, 1 KV head of size 32) saved
with ``save_pretrained`` in float32.
"""

from __future__ import annotations

import pathlib

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A budget for the key value cache keeps memory bounded while tokens stream.",
    "Blocks are scored by attention mass and sampled by weighted reservoir sampling.",
    "Once upon a time there was a little model that could count to one hundred.",
    "one two three four five six seven eight nine ten eleven twelve thirteen",
    "Paris is the capital of France. Berlin is the capital of Germany.",
]


def build_tiny_llama(out_dir: str | pathlib.Path, *, num_layers: int = 4,
                     seed: int = 0) -> pathlib.Path:
    """Write the checkpoint to ``out_dir`` (created) and return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=64, intermediate_size=128,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=8192, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    # Larger-than-default init so attention is far from uniform and greedy argmax is
    # not decided by float noise.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":  # pragma: no cover - manual use
    import sys

    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/nexus_tiny_llama"))
