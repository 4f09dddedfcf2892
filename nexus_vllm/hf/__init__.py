"""Streaming KV-cache eviction on Hugging Face transformers models (Llama family).

``generate`` is the reference end-to-end path that the evaluation harness uses: the same
block decisions as the vLLM plugin (shared across layers and heads, evicted tokens keep
their positions), on a plain ``DynamicCache``.
"""

from nexus_vllm.hf.generate import PromptSplit, SampleResult, encode_prompt, generate, run_sample
from nexus_vllm.hf.streaming import EvictionEvent, StreamingSession, make_config

__all__ = [
    "EvictionEvent",
    "PromptSplit",
    "SampleResult",
    "StreamingSession",
    "encode_prompt",
    "generate",
    "make_config",
    "run_sample",
]
