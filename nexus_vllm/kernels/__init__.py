"""Triton kernels for nexus-vllm, with a pure-torch fallback.

``block_attention_mass_paged`` scores a batch of requests' live KV blocks straight from a
paged cache; ``compact_block_tables`` drops evicted (null) entries from block tables. Both
are ``torch.ops.nexus_vllm.*`` custom ops and import on machines without triton or CUDA
(``backend="auto"`` then uses the torch reference). See ``nexus_vllm.kernels.ops`` for the
exact contracts.
"""

# The public API is ``ops.__all__``: one list, re-exported here as it is.
from nexus_vllm.kernels.ops import *  # noqa: F403
from nexus_vllm.kernels.ops import __all__ as __all__
