"""Test instruments that run inside a server: never imported by a production module
(``tests/integration/test_layers.py`` fails on one that does).

* ``worker_doubles``, ``scheduler_doubles``: the parts that fail on purpose for an
  injected fault. A process loads one only through :func:`nexus_vllm.integration.faults.
  with_doubles`, when ``NEXUS_VLLM_FAULTS`` names its fault (``faults.DOUBLES`` says
  where each lives);
* ``pool_watch``: vLLM's block lists read after each ``schedule()`` (the bound's
  benchmark and tests).
"""
