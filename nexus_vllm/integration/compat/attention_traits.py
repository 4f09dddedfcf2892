"""The attention features eviction cannot run on, as plain values.

``vllm_compat`` reads them from vLLM (a model's ``ModelConfig`` at startup, each attention
layer in the worker); the API server's engine policy (``frontend/engine_policy.py``) and
the worker refuse a model or layer that has any of them, naming it with
:func:`unsupported_attention`. Compacted block tables keep token positions logical but
shorten what attention sees, so anything that reads distances or positions inside
attention would change meaning. Sliding-window layers are the exception when vLLM's
hybrid KV cache manager keeps them in groups of their own: those groups are never
compacted (``vllm_compat.group_role``). Multi-head latent attention (MLA) is not a trait:
its latent cache is one full-attention group (``integration/worker/mla.py``); what it
cannot run with on a platform is checked with the config
(``engine_policy.check_latent_attention``).

This module imports nothing from vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AttentionTraits", "unsupported_attention"]


@dataclass(frozen=True)
class AttentionTraits:
    """Attention features of a model (from its config) or of one attention layer that
    eviction cannot run on (``vllm_compat`` reads them from vLLM); all False: it can."""

    sliding_window_only: bool = False
    sliding_window_one_group: bool = False
    alibi: bool = False
    hybrid: bool = False
    encoder_decoder: bool = False
    non_decoder_attention: bool = False
    mm_prefix: bool = False
    reference_sliding_window: bool = False
    shared_kv_cache: bool = False


# Trait -> how a refusal names it (and why, where it is not obvious).
_TRAIT_NAMES = {
    # Interleaved sliding-window layers are supported through vLLM's hybrid KV cache
    # manager: their groups are left to vLLM and only the full-attention group evicts.
    "sliding_window_only": "sliding-window attention in every layer (no full-attention "
                           "layer to evict from; vLLM already bounds such a cache by its "
                           "window)",
    "sliding_window_one_group": "sliding-window layers in the full-attention KV cache "
                                "group (vLLM's hybrid KV cache manager is off, so compacted "
                                "block tables would shift their window; serve without "
                                "--disable-hybrid-kv-cache-manager)",
    "alibi": "ALiBi position biases (they follow the compacted, not the logical, distance)",
    "hybrid": "hybrid attention/state-space layers",
    "encoder_decoder": "an encoder-decoder architecture",
    "non_decoder_attention": "attention other than decoder self-attention",
    # These two build masks from logical positions that compacted lengths would misplace.
    "mm_prefix": "bidirectional multimodal prefixes",
    "reference_sliding_window": "reference sliding-window attention",
    "shared_kv_cache": "another layer's KV cache (KV sharing)",
}


def unsupported_attention(traits: AttentionTraits) -> list[str]:
    """What in ``traits`` eviction cannot run on, as refusals name it (empty: it can).
    The one check for a model's config at startup and for each layer in the worker."""
    return [text for name, text in _TRAIT_NAMES.items() if getattr(traits, name)]
