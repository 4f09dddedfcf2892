"""What nexus-vllm knows about vLLM's own code, and nothing about eviction policy.

* ``versions``: the supported releases, checked before anything is patched;
* ``catalogue``: every change made to vLLM (class and instance wraps, overrides, grafts,
  install fixes), and the only way to install a wrap;
* ``vllm_compat``: every private vLLM attribute the scheduler and the layers rely on,
  reached through one accessor each;
* ``runners``: the model runners (V1, V2 on CUDA, 0.34's standalone CPU runner) behind one
  adapter interface, chosen by feature detection;
* ``vllm_types``: the vLLM objects the scheduler side reads, as Protocols;
* ``attention_traits``: the attention features eviction cannot run on, as plain values.

The bottom of ``nexus_vllm.integration``: nothing here imports the frontend, scheduler or
worker folders, nor the shared modules above it.
"""
