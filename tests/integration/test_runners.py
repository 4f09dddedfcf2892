"""Runner adapters (``nexus_vllm.integration.compat.runners``) against miniature V2 runners.

The miniature runners follow vLLM's Model Runner V2 step order exactly (0.34
``gpu/model_runner.py`` and ``cpu/standalone_model_runner.py``, ``execute_model``):
finished and preempted requests leave and free their index, new requests take the lowest
free index and overwrite their row, cached requests append their new blocks, staged
writes are applied, then ``prepare_attn`` gathers the batch's rows. vLLM's real
``StagedWriteTensor`` cannot be built on a CPU box (its staging buffers need pinned
memory), so the staged table is modelled with the same two calls; the source canaries
(``test_vllm_sources.py``) pin the call order and signatures in each release.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from nexus_vllm.integration.compat.runners import (
    HostTables,
    RunnerV1,
    StagedTables,
    runner_adapter,
)

WIDTH = 8
NULL = 0


class _StagedTensor:
    """vLLM's ``StagedWriteTensor`` protocol: writes are staged, then applied at once."""

    def __init__(self, rows: int, width: int) -> None:
        self.gpu = np.zeros((rows, width), dtype=np.int32)
        self.staged: list[tuple[int, int, list[int]]] = []
        self.applies = 0

    def stage_write(self, index: int, start: int, x: list[int]) -> None:
        assert index >= 0 and start >= 0 and all(isinstance(v, int) for v in x)
        self.staged.append((index, start, list(x)))

    def apply_write(self) -> None:
        for index, start, x in self.staged:
            self.gpu[index, start:start + len(x)] = x
        self.staged.clear()
        self.applies += 1


class _MiniV2:
    """A V2 runner in miniature: request indices, a block table per index, the step order
    of ``execute_model`` and a ``prepare_attn`` that gathers the batch's rows."""

    def __init__(self, staged: bool, rows: int = 4) -> None:
        self.staged = staged
        if staged:
            self.block_tables = SimpleNamespace(block_tables=[_StagedTensor(rows, WIDTH)])
        else:
            table = np.zeros((rows, WIDTH), dtype=np.int32)
            self.block_tables = SimpleNamespace(block_tables=[torch.from_numpy(table)],
                                                block_tables_np=[table])
        self.req_states = SimpleNamespace(req_id_to_index={})
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.free = list(range(rows))
        self.gathered: np.ndarray | None = None

    def table(self) -> np.ndarray:
        if self.staged:
            return self.block_tables.block_tables[0].gpu
        return self.block_tables.block_tables_np[0]

    def _write(self, idx: int, start: int, ids: list[int]) -> None:
        if self.staged:
            self.block_tables.block_tables[0].stage_write(idx, start, ids)
        else:
            self.table()[idx, start:start + len(ids)] = ids

    def prepare_attn(self, input_batch: Any) -> np.ndarray:
        index = self.req_states.req_id_to_index
        rows = [self.table()[index[r]].copy() for r in input_batch.req_ids]
        self.gathered = np.stack(rows) if rows else np.zeros((0, WIDTH), dtype=np.int32)
        return self.gathered

    def execute_model(self, out: Any, batch: list[str]) -> None:
        index = self.req_states.req_id_to_index
        for req_id in sorted(set(out.finished_req_ids) | set(out.preempted_req_ids)):
            if req_id in index:
                self.free.append(index.pop(req_id))
                self.free.sort()
        for new in out.scheduled_new_reqs:
            idx = index[new.req_id] = self.free.pop(0)
            self._write(idx, 0, list(new.block_ids[0]))
            self.num_blocks[idx] = len(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for req_id, ids in zip(cached.req_ids, cached.new_block_ids):
            if ids is not None:
                idx = index[req_id]
                self._write(idx, int(self.num_blocks[idx]), list(ids[0]))
                self.num_blocks[idx] += len(ids[0])
        if self.staged:
            self.block_tables.block_tables[0].apply_write()
        self.prepare_attn(SimpleNamespace(req_ids=batch))


def _out(new: dict[str, list[int]] | None = None,
         cached: dict[str, list[int] | None] | None = None, finished: tuple[str, ...] = (),
         preempted: tuple[str, ...] = (), resumed: tuple[str, ...] | None = None) -> Any:
    cached = cached or {}
    data = SimpleNamespace(req_ids=list(cached),
                           new_block_ids=[None if v is None else (v,) for v in cached.values()])
    if resumed is not None:  # vLLM <= 0.33 only
        data.resumed_req_ids = set(resumed)
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,))
                            for r, ids in (new or {}).items()],
        scheduled_cached_reqs=data, finished_req_ids=set(finished),
        preempted_req_ids=set(preempted))


def _step(runner: _MiniV2, adapter: Any, out: Any, batch: list[str]) -> None:
    adapter.observe(out)
    runner.execute_model(out, batch)


RUNNERS = [pytest.param(True, id="staged"), pytest.param(False, id="host")]


@pytest.mark.parametrize("staged", RUNNERS)
def test_adapter_is_chosen_by_the_runners_features(staged: bool) -> None:
    runner = _MiniV2(staged)
    adapter = runner_adapter(runner)
    assert type(adapter) is (StagedTables if staged else HostTables)
    v1 = SimpleNamespace(requests={}, input_batch=SimpleNamespace(
        block_table=[], req_id_to_index={}, req_ids=[]))
    assert type(runner_adapter(v1)) is RunnerV1
    with pytest.raises(RuntimeError, match="unknown vLLM model runner"):
        runner_adapter(SimpleNamespace())


def test_v1_writes_the_evicted_groups_table_only() -> None:
    """A hybrid model's full-attention group is not group 0 (Gemma 3: sliding groups
    first): the V1 adapter reads and writes that group's ids and table, never the
    sliding group's."""
    import numpy as np

    tables = [SimpleNamespace(block_table=SimpleNamespace(np=np.full((2, 4), 3)))
              for _ in range(2)]
    state = SimpleNamespace(block_ids=([11, 12, 13], [21, 22, 23]))
    v1 = SimpleNamespace(requests={"a": state}, input_batch=SimpleNamespace(
        block_table=tables, req_id_to_index={"a": 1}, req_ids=["a"]))
    adapter = runner_adapter(v1, group=1)
    assert adapter.logical_row("a") == [21, 22, 23]
    adapter.set_entries("a", [0, 2], [NULL, NULL])
    assert state.block_ids == ([11, 12, 13], [NULL, 22, NULL])
    assert tables[1].block_table.np[1].tolist() == [NULL, 3, NULL, 3]
    assert (tables[0].block_table.np == 3).all()


@pytest.mark.parametrize("staged", RUNNERS)
def test_nulls_land_before_the_gather_and_persist(staged: bool) -> None:
    runner = _MiniV2(staged)
    adapter = runner_adapter(runner)
    _step(runner, adapter, _out(new={"a": [5, 6, 7], "b": [9]}), ["a", "b"])
    assert adapter.batch_req_ids(2) == ["a", "b"]
    adapter.set_entries("a", [1, 0], [NULL, NULL])  # order of columns does not matter
    assert adapter.logical_row("a") == [NULL, NULL, 7]
    _step(runner, adapter, _out(cached={"a": [8], "b": None}), ["b", "a"])
    assert adapter.batch_req_ids(2) == ["b", "a"]
    assert runner.gathered is not None
    assert runner.gathered[1, :4].tolist() == [NULL, NULL, 7, 8]
    assert runner.gathered[0, :1].tolist() == [9]
    # Persistent: the next step's gather still reads the nulls, and nothing is rewritten.
    if staged:
        applies = runner.block_tables.block_tables[0].applies
    _step(runner, adapter, _out(cached={"a": None}), ["a"])
    assert runner.gathered[0, :4].tolist() == [NULL, NULL, 7, 8]
    if staged:
        assert runner.block_tables.block_tables[0].applies == applies + 1  # vLLM's only
    # Restoring an entry (a mask lifted) is a write like any other.
    adapter.set_entries("a", [1], [6])
    _step(runner, adapter, _out(cached={"a": None}), ["a"])
    assert runner.gathered[0, :4].tolist() == [NULL, 6, 7, 8]


@pytest.mark.parametrize("staged", RUNNERS)
def test_writes_follow_the_request_not_its_old_index(staged: bool) -> None:
    """A finished request's index is reused by a new request in the same step: writes
    queued for the old request never reach the newcomer's row, and writes queued for a
    running request land at its index as of this step."""
    runner = _MiniV2(staged)
    adapter = runner_adapter(runner)
    _step(runner, adapter, _out(new={"a": [1, 2], "b": [3, 4]}), ["a", "b"])
    adapter.set_entries("a", [0], [NULL])
    adapter.set_entries("b", [0], [NULL])
    _step(runner, adapter, _out(new={"c": [5, 6]}, cached={"b": None}, finished=("a",)),
          ["c", "b"])
    assert runner.req_states.req_id_to_index["c"] == 0  # a's old index
    assert runner.gathered[0, :2].tolist() == [5, 6]
    assert runner.gathered[1, :2].tolist() == [NULL, 4]
    assert adapter.logical_row("a") is None


@pytest.mark.parametrize("staged", RUNNERS)
@pytest.mark.parametrize("style", ["0.34", "0.33"])
def test_logical_rows_mirror_preemption_and_resumption(staged: bool, style: str) -> None:
    runner = _MiniV2(staged)
    adapter = runner_adapter(runner)
    _step(runner, adapter, _out(new={"a": [1, 2, 3]}), ["a"])
    adapter.set_entries("a", [1], [NULL])
    _step(runner, adapter, _out(preempted=("a",)), [])
    assert adapter.logical_row("a") is None
    if style == "0.34":  # resumed requests come back as new ones
        out = _out(new={"a": [7, 8]})
    else:  # 0.33: the whole list again, flagged as resumed
        out = _out(cached={"a": [7, 8]}, resumed=("a",))
        runner.req_states.req_id_to_index["a"] = runner.free.pop(0)
        runner.num_blocks[runner.req_states.req_id_to_index["a"]] = 0
    adapter.observe(out)
    assert adapter.logical_row("a") == [7, 8]
    assert not adapter.pending.get("a")


def test_batch_order_is_required_from_prepare_attn() -> None:
    runner = _MiniV2(False)
    adapter = runner_adapter(runner)
    adapter.observe(_out(new={"a": [1]}))
    with pytest.raises(RuntimeError, match="prepare_attn"):
        adapter.batch_req_ids(1)


def test_staged_writes_are_grouped_in_runs() -> None:
    runner = _MiniV2(True)
    adapter = runner_adapter(runner)
    _step(runner, adapter, _out(new={"a": [1, 2, 3, 4, 5, 6]}), ["a"])
    adapter.set_entries("a", [4, 1, 2], [NULL, NULL, NULL])
    table = runner.block_tables.block_tables[0]
    calls: list[tuple[int, int, list[int]]] = []
    stage = table.stage_write
    table.stage_write = lambda i, s, x: (calls.append((i, s, list(x))), stage(i, s, x))
    adapter.flush()
    assert calls == [(0, 1, [NULL, NULL]), (0, 4, [NULL])]
    assert table.gpu[0, :6].tolist() == [1, NULL, NULL, 4, NULL, 6]
