"""The API server's side (the ``vllm serve`` process): flags, request validation, the
engine policy and the metrics export.

* ``server_config``: the ``--kv-*`` flags, ``--kv-eviction-config`` files and
  ``--additional-config`` layered into the server's ``EvictionConfig``;
* ``request_args``: each request's ``vllm_xargs`` refused with an HTTP 400 naming the
  field, before it reaches the engine;
* ``engine_policy``: what an evicting server refuses and forces in vLLM's engine
  arguments, as plain functions;
* ``patches``: the monkey-patches of vLLM's API-server classes that wire the three above
  in (each module states why, how, the vLLM versions and the plan to drop it);
* ``serve``: ``nexus-vllm serve``.

Nothing in the engine core's scheduler or in the workers imports from here.
"""
