"""Triton kernels for nexus-vllm, with a pure-torch fallback.

``block_attention_mass_paged`` scores a batch of requests' live KV blocks straight from a
paged cache; ``compact_block_tables`` drops evicted (null) entries from block tables. Both
are ``torch.ops.nexus_vllm.*`` custom ops and import on machines without triton or CUDA
(``backend="auto"`` then uses the torch reference). See ``nexus_vllm.kernels.ops`` for the
exact contracts.
"""

from nexus_vllm.kernels.ops import (
    BACKENDS,
    HAS_TRITON,
    KV_LAYOUTS,
    block_attention_mass_paged,
    block_attention_mass_paged_torch,
    compact_block_tables,
    compact_block_tables_torch,
    resolve_backend,
    triton_interpret_enabled,
)

__all__ = [
    "BACKENDS",
    "HAS_TRITON",
    "KV_LAYOUTS",
    "block_attention_mass_paged",
    "block_attention_mass_paged_torch",
    "compact_block_tables",
    "compact_block_tables_torch",
    "resolve_backend",
    "triton_interpret_enabled",
]
