"""The engine core's side: ``NexusScheduler`` and the eviction decisions it makes.

* ``scheduler``: the ``Scheduler`` subclass vLLM loads through ``scheduler_cls``;
* ``manager``: ``EvictionManager``, the coordinator the scheduler and the KV-cache manager
  wraps call;
* ``request_state``: ``RequestEvictionState``, everything kept per evicting request, and
  the one map of them;
* the parts, each a service over those states: ``live_blocks`` (the block lists, nulled
  and freed), ``admission`` (reserve each request's bound), ``prefix_cache`` (what a
  request may publish and reuse), ``plan_channel`` (step ids, nulls resent until
  acknowledged), ``evictor`` (the worker's scores turned into evictions).

Imports only the shared modules (``protocol``, ``config``, ``metrics``, ``faults``),
``compat`` and ``nexus_vllm.core``: never the API server's or the workers' code.
"""
