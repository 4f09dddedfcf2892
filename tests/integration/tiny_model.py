"""The integration tests' tiny checkpoint: a thin wrapper over the suite's one builder,
:func:`nexus_vllm.hf.testing.save_tiny_checkpoint` (a 4-layer random Llama, 2 query heads,
1 KV head of size 32, a byte-level BPE trained offline, float32 safetensors)."""

from __future__ import annotations

import pathlib

from nexus_vllm.hf.testing import CORPUS as _CORPUS
from nexus_vllm.hf.testing import save_tiny_checkpoint

__all__ = ["_CORPUS", "build_tiny_llama"]


def build_tiny_llama(out_dir: str | pathlib.Path, *, num_layers: int = 4,
                     seed: int = 0) -> pathlib.Path:
    """Write the checkpoint to ``out_dir`` (created) and return it."""
    return save_tiny_checkpoint(out_dir, layers=num_layers, seed=seed)


if __name__ == "__main__":  # pragma: no cover - manual use
    import sys

    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/nexus_tiny_llama"))
