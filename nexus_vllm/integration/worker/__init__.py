"""The workers' side (one process per tensor-parallel rank and pipeline stage):
``NexusWorker`` and the eviction path inside each forward.

* ``worker``: the platform worker subclass vLLM loads through ``worker_cls``;
* ``worker_state``: ``WorkerEvictionState``, the plan applied to the runner's block
  tables, the step's parts wired, the reply built;
* ``request_table``: what the worker keeps of each request, one object per request;
* ``worker_step``: what the step's parts hand each other;
* ``attention``: the attention backends re-registered with two mixins (compaction before
  the builder, query capture before the impl);
* ``compaction``, ``query_ring``, ``block_scorer``: the three parts the mixins and the
  worker call.

Imports only the shared modules (``protocol``, ``config``, ``faults``), ``compat``,
``nexus_vllm.core`` and ``nexus_vllm.kernels``: never the API server's or the
scheduler's code.
"""
