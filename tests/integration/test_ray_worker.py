"""What a Ray worker runs, without Ray: the worker vLLM's Ray executor builds in each
actor, and its RPC dispatch, driving a whole evicting engine in-process.

vLLM's Ray executor is ``RayExecutorV2`` (the only one in 0.33 and 0.34, the default in
0.32, whose older compiled-graph executor, ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``, skips
the worker's methods and is refused: ``engine_policy.check_executor``). Each actor holds a
``RayWorkerProc``: ``initialize_worker`` applies the driver's environment and calls
``WorkerProc.__init__``, which builds vLLM's ``WorkerWrapperBase`` (its ``init_worker``
loads the general plugins in that process, our ``register()``, and resolves
``worker_cls``), then ``init_device`` and ``load_model``; ``run()`` enters
``WorkerProc.worker_busy_loop``, which calls the worker's method by name for every RPC
the executor broadcasts (``_execute_worker_rpc``). The source canaries
(``test_vllm_sources.py::test_ray_worker_runs_the_worker_proc_loop``) pin that shape.

Ray cannot run here: vLLM's CPU platform refuses it ("current platform cpu does not
support ray"), and ``vllm.v1.executor.ray_executor_v2`` does not even import without
Ray. So this test builds the same ``WorkerProc`` in-process, with the arguments
``RayWorkerProc`` gives it and its message queues left out (Ray's transport), and gives
vLLM an executor class that sends every RPC through ``_execute_worker_rpc``.

Covered: the plugin loading in the worker's process, ``worker_cls`` resolved to
``NexusWorker``, its ``load_model`` and ``initialize_from_config``, and every
``execute_model`` / ``sample_tokens`` of an evicting engine through WorkerProc's dispatch
(plans applied, replies acknowledged, blocks evicted and all freed). Not covered: Ray
actors and placement groups, the message queues across nodes (the multiprocess
executor's tests pickle plans and replies through the same queues), GPU id mapping.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from tests.integration.conftest import HAS_VLLM

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]

NEXUS = {"method": "nexus", "max_tokens": 256, "chunk_size": 128, "block_size": 32,
         "seed": 7}


def _uncache_envs() -> None:
    import vllm.envs

    vllm.envs.disable_envs_cache()


def _executor_class() -> type:
    """vLLM's in-process executor, its worker built and driven as a Ray actor's is."""
    import cloudpickle
    from vllm.v1.executor.multiproc_executor import WorkerProc
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    from vllm.v1.outputs import AsyncModelRunnerOutput

    class LocalWorkerProc(WorkerProc):
        def _init_message_queues(self, input_shm_handle: Any, vllm_config: Any) -> None:
            self.rpc_broadcast_mq = self.worker_response_mq = None  # Ray's transport
            self.peer_response_handles = []

    class WorkerProcExecutor(UniProcExecutor):
        def _init_executor(self) -> None:
            distributed_init_method, rank, local_rank = self._distributed_args()
            # RayWorkerProc.initialize_worker's call (shared_worker_lock=None there too).
            self.proc = LocalWorkerProc(
                vllm_config=self.vllm_config, local_rank=local_rank, rank=rank,
                distributed_init_method=distributed_init_method, input_shm_handle=None,
                shared_worker_lock=None, is_driver_worker=True)
            self.driver_worker = self.proc.worker
            self.rpcs: list[str] = []

        def collective_rpc(self, method: Any, timeout: float | None = None,
                           args: tuple = (), kwargs: dict | None = None,
                           non_block: bool = False, single_value: bool = False) -> Any:
            outputs: list[Any] = []
            self.proc.handle_output = outputs.append  # what the busy loop enqueues
            name = method if isinstance(method, str) else cloudpickle.dumps(method)
            self.rpcs.append(method if isinstance(method, str) else "<function>")
            self.proc._execute_worker_rpc((name, tuple(args), kwargs or {}, None))
            (output,) = outputs
            if isinstance(output, Exception):
                raise output
            if isinstance(output, AsyncModelRunnerOutput):
                output = output.get_output()  # WorkerProc.enqueue_output does the same
            value = output if single_value else [output]
            if not non_block:
                return value
            future: Future[Any] = Future()
            future.set_result(value)
            return future

    return WorkerProcExecutor


def test_an_evicting_engine_runs_through_the_ray_actor_worker(tiny_model, monkeypatch) -> None:  # noqa: ANN001
    from vllm import LLM, SamplingParams

    from nexus_vllm.integration.worker.worker import NexusWorker
    from tests.integration.test_e2e_parallel import PROMPTS

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in-process
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=tiny_model, distributed_executor_backend=_executor_class(),
              additional_config={"nexus": dict(NEXUS)}, enforce_eager=True,
              dtype="float32", max_model_len=4096, max_num_seqs=8, block_size=32,
              num_gpu_blocks_override=160)
    try:
        # ignore_eos: 16 tokens each by construction (a random model may sample its EOS).
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0,
                                                    ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outs] == [16, 16]
        core = llm.llm_engine.engine_core.engine_core
        executor, scheduler = core.model_executor, core.scheduler
        worker = executor.proc.worker.worker  # WorkerWrapperBase.worker
        # Built by WorkerProc.__init__ (load_model there: the query ring is allocated),
        # then driven by name through its dispatch.
        assert type(worker) is NexusWorker and worker.nexus_state.ring.ring is not None
        assert {"initialize_from_config", "execute_model", "sample_tokens"} <= set(
            executor.rpcs)
        nexus = scheduler.nexus_manager
        assert nexus.counters.evicted_blocks > 0
        assert dict(nexus.counters.faults) == {}  # every plan applied and acknowledged
        assert worker.nexus_state.last_step == nexus.channel.step_id == nexus.channel.acknowledged
        assert nexus.pool.num_free() == nexus.pool.num_usable()  # every block back
    finally:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        del llm
        cleanup_dist_env_and_memory()
        _uncache_envs()  # WorkerProc.__init__ froze vllm.envs for this process


def test_the_compiled_graph_ray_executor_is_refused() -> None:
    """vLLM 0.32's compiled-graph Ray executor runs ``worker.model_runner.execute_model``
    from its graph, past the worker's eviction hooks: no plan would ever apply."""
    from nexus_vllm.integration.frontend.engine_policy import check_executor

    check_executor("nexus", None)
    with pytest.raises(ValueError, match="--kv-eviction nexus: --distributed-executor-backend "
                                         "ray with vLLM's RayDistributedExecutor is not "
                                         "supported .* VLLM_USE_RAY_V2_EXECUTOR_BACKEND"):
        check_executor("nexus", "RayDistributedExecutor")


def test_which_ray_executor_skips_the_worker(monkeypatch) -> None:  # noqa: ANN001
    """Detected from what vLLM would run: on 0.32 the compiled-graph executor when
    ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0`` (RayExecutorV2 by default); on 0.33+ there is
    no such executor. Other backends run the worker's methods."""
    import importlib.util
    from types import SimpleNamespace

    from nexus_vllm.integration.compat.vllm_compat import executor_skipping_worker

    _uncache_envs()

    def config(backend: str) -> Any:
        return SimpleNamespace(parallel_config=SimpleNamespace(
            distributed_executor_backend=backend))

    assert executor_skipping_worker(config("mp")) is None
    assert executor_skipping_worker(config("uni")) is None
    if importlib.util.find_spec("vllm.v1.executor.ray_executor") is None:
        assert executor_skipping_worker(config("ray")) is None  # RayExecutorV2 only
        return
    # RayExecutorV2 by default (it imports only where Ray is installed; not refused).
    assert executor_skipping_worker(config("ray")) is None
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    assert executor_skipping_worker(config("ray")) == "RayDistributedExecutor"
