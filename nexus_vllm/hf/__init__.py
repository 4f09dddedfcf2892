"""Streaming KV-cache eviction on Hugging Face transformers models (Llama family, and
hybrid sliding-window models such as Gemma 3: their full-attention layers are evicted).

``generate`` is the reference end-to-end path that the evaluation harness uses: the same
block decisions as the vLLM plugin (shared across layers and heads, evicted tokens keep
their positions, events by the same rule), on a plain ``DynamicCache``. ``generate_ids``
streams a token-id prompt exactly as the plugin chunks it: the same inputs give the same
evictions on both paths (tested end to end against a server). ``run_probes`` runs many
such requests over one growing stream (the turns of a conversation) in one pass.
"""

from nexus_vllm.hf.dialogue import Probe, ProbeResult, run_probes
from nexus_vllm.hf.events import EvictionEvent, make_config
from nexus_vllm.hf.generate import (
    PromptSplit,
    SampleResult,
    encode_prompt,
    generate,
    generate_ids,
    run_sample,
)
from nexus_vllm.hf.streaming import StreamingSession

__all__ = [
    "EvictionEvent",
    "Probe",
    "ProbeResult",
    "PromptSplit",
    "SampleResult",
    "StreamingSession",
    "encode_prompt",
    "generate",
    "generate_ids",
    "make_config",
    "run_probes",
    "run_sample",
]
