"""``python -m nexus_vllm.plan``: the same as ``nexus-vllm plan``."""

from nexus_vllm.plan.cli import main

raise SystemExit(main())
