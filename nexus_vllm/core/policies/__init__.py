"""Eviction policies: one small frozen dataclass each, sharing the forced set.

A policy sees the :class:`~nexus_vllm.core.evidence.Evidence` of one request's event (a
mapping from evidence kind to tensor over its live blocks in logical order: the window's
attention mass ``[W, N]``, key norms, expected attention; :mod:`nexus_vllm.core.evidence`)
and returns the blocks to KEEP. Every policy keeps the forced set: the first
``sink_blocks`` blocks (the attention sink), the newest ``recent_blocks`` full blocks and
the current (last) block. The rest of the budget is filled by
:meth:`EvictionPolicy.score` and the policy's sampler.

A policy declares what it needs, so callers ask it instead of testing its name:
``needs`` (which evidence it reads), ``query_rows`` (how many of the newest window rows of
the mass it reads: the scorer computes no more) and ``stochastic`` (whether its choice
depends on the generator). The vLLM plugin serves every policy: each evidence kind has a
worker gatherer (:mod:`nexus_vllm.core.evidence`). Its knobs are its dataclass fields
(:meth:`EvictionPolicy.knobs`), and what they become at prefill events is declared here
too (``prefill_defaults``, ``prompt_end_defaults``), so
:class:`~nexus_vllm.core.EvictionConfig` names no knob of any policy.

Adding a policy is one ``@register_policy`` class plus one row in the tests' case table
(``tests/core/policy_cases.py``). The class may live in another module: :data:`METHODS`
reads the registry when asked, so configs, the server's flags, request validation and the
evaluation CLI accept it as soon as it is registered.

The package: :mod:`.base` (the shared knobs and their defaults, the forced set, carry,
:class:`EvictionPolicy` and the registry), :mod:`.nexus` (Nexus Sampling),
:mod:`.baselines` (the other policies) and :mod:`.key_norm_prior` (the key-norm prior's
maths). Every name is importable from here.
"""

# isort: off
# Registration order is METHODS' order: Nexus, the default method, first.
from . import nexus  # noqa: F401
from . import baselines  # noqa: F401
# isort: on
from ..evidence import Evidence
from .base import (
    METHODS,
    POLICIES,
    SHARED_KNOBS,
    EvictionPolicy,
    MethodNames,
    PolicyState,
    carry_forward,
    check_shared_knobs,
    forced_blocks,
    forced_count,
    forced_tail,
    get_policy,
    head_granular_methods,
    knob_owners,
    knob_refusal,
    no_head_score,
    register_policy,
)
from .baselines import (
    ExpectedAttentionPolicy,
    H2OPolicy,
    KNormPolicy,
    RandomPolicy,
    ReconstructionPolicy,
    SnapKVPolicy,
    StreamingPolicy,
    TOVAPolicy,
)
from .key_norm_prior import (
    KNORM_SPREAD_FLOOR,
    key_norms_are_flat,
    standardized_head_norms,
    standardized_key_norms,
)
from .nexus import NexusPolicy

__all__ = [
    "KNORM_SPREAD_FLOOR",
    "METHODS",
    "POLICIES",
    "SHARED_KNOBS",
    "Evidence",
    "EvictionPolicy",
    "ExpectedAttentionPolicy",
    "H2OPolicy",
    "KNormPolicy",
    "MethodNames",
    "NexusPolicy",
    "PolicyState",
    "RandomPolicy",
    "ReconstructionPolicy",
    "SnapKVPolicy",
    "StreamingPolicy",
    "TOVAPolicy",
    "carry_forward",
    "check_shared_knobs",
    "forced_blocks",
    "forced_count",
    "forced_tail",
    "get_policy",
    "head_granular_methods",
    "knob_owners",
    "knob_refusal",
    "no_head_score",
    "key_norms_are_flat",
    "register_policy",
    "standardized_head_norms",
    "standardized_key_norms",
]
