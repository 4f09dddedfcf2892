"""``nexus-vllm size``: size a deployment before starting it.

From a model's shape and the GPUs, how many KV blocks each GPU holds, and how many
requests of a given length run at once on stock vLLM and with eviction::

    nexus-vllm size --model llama-3.1-8b --gpu-memory-gib 141 --context 32768 --budget 0.2

One module per reason to change:

* :mod:`.shape`: what sizing needs of a model (built-in, or an HF ``config.json``), its
  sliding-window layers included, and multi-head latent attention (DeepSeek-V2/V3: one
  latent row per token per layer, whole on every TP rank);
* :mod:`.groups`: vLLM's KV cache groups (one, or for a hybrid sliding-window model groups
  of equal layer count sharing the pool) and a request's blocks in a sliding group;
* :mod:`.memory`: KV blocks per GPU by vLLM's rule (``--pool-blocks N`` skips it and takes
  vLLM's ``--num-gpu-blocks-override``; vLLM keeps block 0 as its null block, so ``N - 1``
  blocks hold requests);
* :mod:`.burst`: concurrent requests, a burst run step by step through the server's
  admission (:func:`~nexus_vllm.core.budget.bound_blocks`,
  :func:`~nexus_vllm.core.budget.peak_from`) and stock vLLM's;
* :mod:`.report`: the sizing those make and the text it prints;
* :mod:`.cli`: the command's flags.

Only the standard library, ``nexus_vllm.core`` and the budget parser are imported: no
vLLM, so a laptop can size a GPU deployment.
"""

from __future__ import annotations

from .burst import (
    OUTPUT_PER_PROMPT,
    SimResult,
    simulate_burst,
    split_context,
    stock_admission_blocks,
    stock_bound_blocks,
    window_allowance,
)
from .cli import build_parser, main, sizing_from_args
from .groups import (
    KVGroup,
    eviction_refusal,
    kv_cache_groups,
    layers_per_block,
    pp_stages,
    window_held_blocks,
    window_max_blocks,
)
from .memory import GIB, block_bytes_per_gpu, kv_pool_blocks, page_bytes_per_layer
from .report import HYBRID_STEP_TOKENS, Sizing, format_sizing, size_replica
from .shape import (
    BUILTIN_CONFIGS,
    BUILTIN_MODELS,
    DTYPE_BYTES,
    MODEL_TYPE_DEFAULTS,
    ModelShape,
    mla_param_count,
    model_shape,
    param_count,
    sliding_layers,
)

__all__ = ["BUILTIN_CONFIGS", "BUILTIN_MODELS", "DTYPE_BYTES", "GIB", "HYBRID_STEP_TOKENS",
           "MODEL_TYPE_DEFAULTS", "OUTPUT_PER_PROMPT", "KVGroup", "ModelShape", "Sizing",
           "SimResult", "block_bytes_per_gpu", "build_parser", "eviction_refusal",
           "format_sizing", "kv_cache_groups", "kv_pool_blocks", "layers_per_block", "main",
           "mla_param_count", "model_shape", "page_bytes_per_layer", "param_count", "pp_stages", "size_replica",
           "sizing_from_args", "simulate_burst", "sliding_layers", "split_context",
           "stock_admission_blocks", "stock_bound_blocks", "window_allowance",
           "window_held_blocks", "window_max_blocks"]
