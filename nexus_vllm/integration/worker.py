"""Worker subclass selected by ``worker_cls`` for evicting configurations.

Each step it (1) applies the evictions of the step's :class:`StepPlan` to the model
runner's logical block tables (entry -> null block 0) before the runner prepares inputs,
(2) arms the attention hook that keeps query windows and scores the requests due, and
(3) attaches the scores to the step's ``ModelRunnerOutput`` for the scheduler.

The base class is the platform's worker (``CPUWorker`` on CPU, ``Worker`` on CUDA). On
CPU the attention backend override is registered here, so a server without eviction
never sees it.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.logger import init_logger
from vllm.platforms import current_platform

from nexus_vllm.integration.channel import PLAN_ATTR, SCORES_ATTR, StepPlan, worker_state

logger = init_logger(__name__)

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _BaseWorker
else:  # pragma: no cover - GPU path, exercised by the device check only
    from vllm.v1.worker.gpu_worker import Worker as _BaseWorker  # type: ignore[assignment]

__all__ = ["NexusWorker"]


def _register_backend() -> None:
    if not current_platform.is_cpu():
        # Startup already refuses evicting configs off CPU (patches/engine_args.py).
        raise RuntimeError("nexus-vllm: block-table compaction exists for CPU_ATTN only")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from nexus_vllm.integration.backend import BACKEND_PATH

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)


class NexusWorker(_BaseWorker):  # type: ignore[misc,valid-type]
    """Platform worker + eviction plan application + score hand-back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _register_backend()
        super().__init__(*args, **kwargs)
        self._nexus_scores: dict[str, Any] = {}

    def execute_model(self, scheduler_output: Any) -> Any:
        plan: StepPlan | None = getattr(scheduler_output, PLAN_ATTR, None)
        state = worker_state()
        if plan is not None:
            state.begin_step(self.model_runner, plan, set(scheduler_output.finished_req_ids))
        try:
            output = super().execute_model(scheduler_output)
        finally:
            if plan is not None:
                self._nexus_scores.update(state.end_step())
        return self._attach(output)

    def sample_tokens(self, grammar_output: Any) -> Any:
        saved = self._park_discarded_generators() if current_platform.is_cpu() else {}
        try:
            output = super().sample_tokens(grammar_output)
        finally:
            generators = self.model_runner.input_batch.generators
            for row, (gen, rng_state) in saved.items():
                gen.set_state(rng_state)
                generators[row] = gen
        return self._attach(output)

    def _park_discarded_generators(self) -> dict[int, tuple[Any, Any]]:
        """Work around a vLLM 0.32 CPU bug hit by every chunked prefill.

        For a request whose sampled token is discarded (a partial prefill chunk) vLLM
        rewinds its seeded generator with ``set_offset``, which CPU generators do not
        support ("CPU Generator does not use offset"): the engine dies. Evicting configs
        prefill in chunks, so a seeded request would kill the server. We take those
        generators out for the sampling step (the discarded draw uses the global RNG) and
        put them back untouched: the same effect as the rewind.
        """
        runner = self.model_runner
        mask = getattr(runner, "discard_request_mask", None)
        generators = runner.input_batch.generators
        if mask is None or not generators:
            return {}
        saved = {}
        for row in mask.np[: runner.input_batch.num_reqs].nonzero()[0].tolist():
            gen = generators.pop(int(row), None)
            if gen is not None:
                saved[int(row)] = (gen, gen.get_state())
        return saved

    def _attach(self, output: Any) -> Any:
        if output is None or not self._nexus_scores:
            return output
        if not hasattr(output, "sampled_token_ids"):
            # AsyncModelRunnerOutput: keep the scores for the next real output (async
            # scheduling is turned off for evicting configs, so this is a fallback).
            return output
        # Never mutate a shared constant such as EMPTY_MODEL_RUNNER_OUTPUT.
        output = copy.copy(output)
        setattr(output, SCORES_ATTR, self._nexus_scores)
        self._nexus_scores = {}
        return output
