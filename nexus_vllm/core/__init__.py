"""Pure PyTorch reference of Nexus Sampling and its baselines (no vLLM import).

This package is the oracle that the Triton kernels, the vLLM plugin and the evaluation
are tested against.
"""

from ._validate import ConfigError
from .config import EvictionConfig
from .evidence import EVIDENCE_KINDS, EvidenceKind, evidence_kind, register_evidence
from .policies import (
    METHODS,
    POLICIES,
    EvictionPolicy,
    Evidence,
    ExpectedAttentionPolicy,
    H2OPolicy,
    KNormPolicy,
    NexusPolicy,
    RandomPolicy,
    SnapKVPolicy,
    StreamingPolicy,
    TOVAPolicy,
    carry_forward,
    forced_blocks,
    forced_count,
    forced_tail,
    get_policy,
    register_policy,
)
from .rotary import Rotary
from .sampling import SAMPLERS, inclusion_probabilities, sample_blocks
from .scoring import (
    ATTENTION_REDUCES,
    block_attention_mass,
    block_attention_mass_paged,
    cdiv,
    combine_layer_masses,
    gather_paged_keys,
    normalize_rows,
    num_blocks_for,
)
from .trigger import EvictionTrigger, first_prompt_event
from .weights import (
    DIRECT_MODES,
    INDIRECT_MODES,
    WALK_ROWS,
    direct_scores,
    indirect_scores,
    nexus_weights,
)

__all__ = [
    "ATTENTION_REDUCES",
    "DIRECT_MODES",
    "EVIDENCE_KINDS",
    "INDIRECT_MODES",
    "METHODS",
    "POLICIES",
    "SAMPLERS",
    "WALK_ROWS",
    "ConfigError",
    "EvictionConfig",
    "Evidence",
    "EvictionPolicy",
    "EvidenceKind",
    "ExpectedAttentionPolicy",
    "EvictionTrigger",
    "H2OPolicy",
    "KNormPolicy",
    "NexusPolicy",
    "RandomPolicy",
    "SnapKVPolicy",
    "StreamingPolicy",
    "TOVAPolicy",
    "block_attention_mass",
    "block_attention_mass_paged",
    "carry_forward",
    "cdiv",
    "combine_layer_masses",
    "direct_scores",
    "evidence_kind",
    "first_prompt_event",
    "forced_blocks",
    "forced_count",
    "forced_tail",
    "gather_paged_keys",
    "get_policy",
    "inclusion_probabilities",
    "indirect_scores",
    "nexus_weights",
    "normalize_rows",
    "num_blocks_for",
    "register_evidence",
    "register_policy",
    "Rotary",
    "sample_blocks",
]
