"""One test per vLLM internal the plugin hooks: fail loudly when vLLM changes it.

Pinned to vLLM 0.32.0. When one of these fails after a vLLM upgrade, re-read the hooked
code (paths in ``nexus_vllm/integration/patches/*`` and the subclass modules) before
changing the expected signature here.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from tests.integration.conftest import HAS_VLLM

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")


def _params(fn) -> list[str]:  # noqa: ANN001
    return list(inspect.signature(inspect.unwrap(fn)).parameters)


def test_vllm_version_pinned() -> None:
    import vllm

    assert vllm.__version__.startswith("0.32."), vllm.__version__


def test_engine_args_cli_hooks() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    assert _params(EngineArgs.add_cli_args)[:1] == ["parser"]
    assert _params(EngineArgs.from_cli_args.__func__) == ["cls", "args"]  # type: ignore[attr-defined]
    assert _params(EngineArgs.create_engine_config)[0] == "self"
    # AsyncEngineArgs.add_cli_args loads general plugins before EngineArgs.add_cli_args.
    src = inspect.getsource(AsyncEngineArgs.add_cli_args)
    assert src.index("load_general_plugins()") < src.index("EngineArgs.add_cli_args(parser)")
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert {"scheduler_cls", "worker_cls", "block_size", "enable_prefix_caching",
            "enable_chunked_prefill", "long_prefill_token_threshold", "async_scheduling",
            "scheduler_reserve_full_isl", "additional_config"} <= fields


def test_input_processor_validate_params() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    assert _params(InputProcessor._validate_params) == ["self", "params", "supported_tasks"]
    # Raised from _validate_params, it becomes an HTTP 400 (checked end to end in
    # test_e2e_serve.py); the constructor takes the field name.
    assert "parameter" in _params(VLLMValidationError.__init__)


def test_stat_logger_manager_record_and_stats_field() -> None:
    from vllm.v1.metrics.loggers import StatLoggerManager
    from vllm.v1.metrics.stats import SchedulerStats

    assert _params(StatLoggerManager.record) == [
        "self", "scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx"]
    field = {f.name: f for f in dataclasses.fields(SchedulerStats)}["num_kv_fetch_reqs_by_stage"]
    assert "dict[str, int]" in str(field.type)


def test_scheduler_hooks() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    assert _params(Scheduler.schedule)[:1] == ["self"]
    assert _params(Scheduler.update_from_output) == [
        "self", "scheduler_output", "model_runner_output"]
    assert _params(Scheduler.get_request_counts) == ["self"]
    assert "spec_decoding_stats" in _params(Scheduler.make_stats)
    # The per-request prefill cap is dropped when one request is eligible; our
    # get_request_counts override relies on this being the first count in schedule().
    src = inspect.getsource(Scheduler.schedule)
    assert src.count("self.get_request_counts()") >= 1
    first = src.index("self.get_request_counts()")
    assert first < src.index("if num_eligible_reqs > 1") < src.index(
        "if 0 < long_prefill_token_threshold < num_new_tokens")


def test_kv_cache_manager_internals() -> None:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    pool = BlockPool(num_gpu_blocks=8, enable_caching=False, hash_block_size=32)
    assert pool.null_block.is_null and pool.null_block.block_id == 0
    assert pool.get_num_free_blocks() == 7
    blocks = pool.get_new_blocks(3)
    pool.free_blocks([blocks[1], pool.null_block])  # null block is never ref-counted
    assert pool.get_num_free_blocks() == 5
    assert "req_to_blocks" in inspect.getsource(SingleTypeKVCacheManager.__init__)
    assert hasattr(KVCacheBlock, "is_null") or "is_null" in inspect.getsource(KVCacheBlock)


def test_worker_hooks() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    assert _params(Worker.execute_model) == ["self", "scheduler_output"]
    assert _params(Worker.sample_tokens) == ["self", "grammar_output"]
    src = inspect.getsource(GPUModelRunner._bookkeeping_sync)
    assert "discard_request_mask" in src and "set_offset" in src
    src = inspect.getsource(GPUModelRunner._update_states)
    assert "req_state.block_ids" in src and "block_table.append_row" in src


def test_block_table_buffers() -> None:
    from vllm.v1.worker.block_table import BlockTable

    assert _params(BlockTable.append_row) == ["self", "block_ids", "row_idx"]
    assert "self.block_table = self._make_buffer" in inspect.getsource(BlockTable.__init__)


def test_cpu_attention_backend_hooks() -> None:
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackendImpl,
        CPUAttentionMetadataBuilder,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    assert _params(CPUAttentionMetadataBuilder.build) == [
        "self", "common_prefix_len", "common_attn_metadata", "fast_build"]
    assert _params(CPUAttentionBackendImpl.forward)[:8] == [
        "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"]
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    assert {"block_table_tensor", "seq_lens", "max_seq_len", "query_start_loc"} <= fields
    assert _params(register_backend)[:2] == ["backend", "class_path"]
    assert AttentionBackendEnum.CPU_ATTN.name == "CPU_ATTN"


def test_our_subclasses_import() -> None:
    from nexus_vllm.integration.backend import NexusCPUAttentionBackend
    from nexus_vllm.integration.scheduler import NexusScheduler
    from nexus_vllm.integration.worker import NexusWorker

    assert NexusCPUAttentionBackend.get_name() == "CPU_ATTN"
    assert NexusScheduler.update_from_output is not None and NexusWorker is not None


def test_register_is_idempotent_and_lazy() -> None:
    import subprocess
    import sys

    code = (
        "import sys, nexus_vllm\n"
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules\n"
        "nexus_vllm.register(); nexus_vllm.register()\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "f = EngineArgs.add_cli_args\n"
        "nexus_vllm._REGISTERED = False; nexus_vllm.register()\n"
        "assert EngineArgs.add_cli_args is f\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
