"""A tiny random-weight DeepSeek-V2-shaped checkpoint (multi-head latent attention, MLA),
for plumbing tests only: random weights, no quality.

vLLM 0.32's CPU MLA backend (``CPU_MLA``) takes one latent size only, ``kv_lora_rank +
qk_rope_head_dim = 512 + 64 = 576`` (its decode kernel is compiled for it), so the latent
and rotary widths are DeepSeek-V2's; everything else is tiny: hidden 64, 2 heads with
32-wide non-rotary query/key parts and 32-wide values, no query LoRA (``q_proj``
directly), a dense first layer and small MoE layers after it (4 routed experts, 2 per
token, 1 shared), and the suite's trained tokenizer (:func:`trained_tokenizer`). ~7 MB.

Nothing is downloaded; it builds in a second or two.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import DeepseekV2ForCausalLM

__all__ = ["MLA_KV_LORA_RANK", "MLA_LATENT_SIZE", "MLA_ROPE_DIM", "save_tiny_deepseek_v2",
           "tiny_deepseek_v2"]

MLA_KV_LORA_RANK = 512
MLA_ROPE_DIM = 64
# One cache row per token: [c_kv (512) | k_pe (64)], what CPU_MLA accepts.
MLA_LATENT_SIZE = MLA_KV_LORA_RANK + MLA_ROPE_DIM


def tiny_deepseek_v2(vocab_size: int, *, layers: int = 4, heads: int = 2,
                     dense_layers: int = 1, experts: int = 4, seed: int = 0,
                     eos_token_id: int | None = None,
                     bos_token_id: int | None = None) -> DeepseekV2ForCausalLM:
    """A randomly initialised ``DeepseekV2ForCausalLM`` (transformers).

    Parameters
    ----------
    vocab_size : int
        ``len(tokenizer)``.
    layers, heads : int
        Depth and query heads (MLA: one latent KV row per token, shared by the heads).
    dense_layers : int
        The first ``dense_layers`` layers use a dense MLP (``first_k_dense_replace``),
        the others a mixture of ``experts`` routed experts (2 per token) and 1 shared.
    seed : int
        Every matrix is drawn from N(0, ``INIT_STD``), as the suite's other tiny models.
    """
    import torch
    import transformers

    from nexus_vllm.hf.testing import INIT_STD, finish_tiny_model

    torch.manual_seed(seed)
    cfg = transformers.DeepseekV2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, n_shared_experts=1, n_routed_experts=experts,
        num_experts_per_tok=2, first_k_dense_replace=dense_layers,
        topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.0, kv_lora_rank=MLA_KV_LORA_RANK, q_lora_rank=None,
        qk_rope_head_dim=MLA_ROPE_DIM, qk_nope_head_dim=32, v_head_dim=32,
        head_dim=MLA_ROPE_DIM, max_position_embeddings=8192, initializer_range=INIT_STD,
        eos_token_id=eos_token_id, bos_token_id=bos_token_id, pad_token_id=None,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return finish_tiny_model(transformers.DeepseekV2ForCausalLM(cfg), eos_token_id)


def save_tiny_deepseek_v2(out_dir: str | pathlib.Path, *, layers: int = 4,
                          dense_layers: int = 1, seed: int = 0) -> pathlib.Path:
    """Save a :func:`tiny_deepseek_v2` (float32 safetensors) and the suite's trained
    tokenizer (chat template included) to ``out_dir`` (created); return it."""
    from nexus_vllm.hf.testing import trained_tokenizer

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = trained_tokenizer()
    tok.save_pretrained(out)
    model = tiny_deepseek_v2(len(tok), layers=layers, dense_layers=dense_layers, seed=seed,
                             eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model.save_pretrained(out, safe_serialization=True)
    return out
