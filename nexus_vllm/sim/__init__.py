"""Synthetic streams for comparing eviction policies (``nexus-vllm simulate``).

``simulate`` holds the simulation (torch only); ``cli`` the command and its plot. Kept
out of ``nexus_vllm.core`` so the oracle package has no CLI, plotting or progress bars.
"""

from nexus_vllm.sim.simulate import (
    BLOCK_CLASSES,
    DEFAULT_POLICIES,
    SimulationConfig,
    SimulationResult,
    simulate,
)

__all__ = ["BLOCK_CLASSES", "DEFAULT_POLICIES", "SimulationConfig", "SimulationResult",
           "simulate"]
