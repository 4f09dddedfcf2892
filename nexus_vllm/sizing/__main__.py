"""``python -m nexus_vllm.sizing``: the same as ``nexus-vllm size``."""

from nexus_vllm.sizing.cli import main

raise SystemExit(main())
