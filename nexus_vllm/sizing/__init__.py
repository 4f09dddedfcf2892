"""``nexus-vllm plan``: size a deployment before starting it.

From a model's shape and the GPUs, how many KV blocks each GPU holds, and how many
requests of a given length run at once on stock vLLM and with eviction::

    nexus-vllm plan --model llama-3.1-8b --gpu-memory-gib 141 --context 32768 --budget 0.2

One module per reason to change:

* :mod:`.shape`: what sizing needs of a model (built-in, or an HF ``config.json``);
* :mod:`.memory`: KV blocks per GPU by vLLM's rule (``--pool-blocks N`` skips it and takes
  vLLM's ``--num-gpu-blocks-override``; vLLM keeps block 0 as its null block, so ``N - 1``
  blocks hold requests);
* :mod:`.burst`: concurrent requests, a burst run step by step through the server's
  admission (:meth:`EvictionConfig.bound_blocks`, :meth:`EvictionConfig.peak_from`) and
  stock vLLM's;
* :mod:`.report`: the plan those make and the text it prints;
* :mod:`.cli`: the command's flags.

Only the standard library, ``nexus_vllm.core`` and the budget parser are imported: no
vLLM, so a laptop can plan a GPU deployment.
"""

from __future__ import annotations

from .burst import (
    OUTPUT_PER_PROMPT,
    SimResult,
    simulate_burst,
    split_context,
    stock_admission_blocks,
    stock_bound_blocks,
)
from .cli import build_parser, main, plan_from_args
from .memory import GIB, block_bytes_per_gpu, kv_pool_blocks
from .report import Plan, format_plan, make_plan
from .shape import (
    BUILTIN_CONFIGS,
    BUILTIN_MODELS,
    DTYPE_BYTES,
    ModelShape,
    model_shape,
    param_count,
)

__all__ = ["BUILTIN_CONFIGS", "BUILTIN_MODELS", "DTYPE_BYTES", "GIB", "OUTPUT_PER_PROMPT",
           "ModelShape", "Plan", "SimResult", "block_bytes_per_gpu", "build_parser",
           "format_plan", "kv_pool_blocks", "main", "make_plan", "model_shape",
           "param_count", "plan_from_args", "simulate_burst", "split_context",
           "stock_admission_blocks", "stock_bound_blocks"]
