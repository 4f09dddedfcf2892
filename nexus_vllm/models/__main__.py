"""``python -m nexus_vllm.models``: the same as ``nexus-vllm prepare-model``."""

from nexus_vllm.models.registry import main

raise SystemExit(main())
