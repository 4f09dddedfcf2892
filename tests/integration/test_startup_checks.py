"""Startup of an evicting server on a pretend CUDA platform: PIECEWISE graphs, the V1
model runner, and every refusal with its message (no GPU, no server; a few seconds)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.integration.conftest import HAS_VLLM
from tests.integration.test_config import LOCAL_MODEL

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

NEXUS = {"nexus": {"method": "nexus", "max_tokens": 1024}}


@pytest.fixture
def cuda(monkeypatch):  # noqa: ANN001, ANN201
    """``current_platform`` answers like a CUDA box; the V2-runner switch is unset."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    return monkeypatch


def test_the_runner_vllm_picks_is_kept(cuda) -> None:  # noqa: ANN001
    """Evicting servers run on whatever model runner vLLM picks (every family has an
    adapter): nothing forces or refuses Model Runner V2."""
    import os

    from nexus_vllm.integration.patches.engine_args import translate_engine_args

    cuda.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert translate_engine_args(_args()) is not None
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    cuda.delenv("VLLM_USE_V2_MODEL_RUNNER")
    assert translate_engine_args(_args()) is not None
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


def _args(**kw):  # noqa: ANN003, ANN202
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(model=LOCAL_MODEL, additional_config=dict(NEXUS), **kw)


def test_piecewise_graphs_are_set(cuda) -> None:  # noqa: ANN001
    from vllm.config.compilation import CUDAGraphMode

    from nexus_vllm.integration.patches.engine_args import translate_engine_args

    ea = _args(tensor_parallel_size=2)  # tensor parallelism is allowed
    assert translate_engine_args(ea) is not None
    assert ea.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert ea.async_scheduling is False and ea.enable_chunked_prefill is True
    assert ea.worker_cls == "nexus_vllm.integration.worker.NexusWorker"


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE"])
def test_explicit_non_full_modes_are_kept(cuda, mode) -> None:  # noqa: ANN001
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode

    from nexus_vllm.integration.patches.engine_args import translate_engine_args

    ea = _args(compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode[mode]))
    translate_engine_args(ea)
    assert ea.compilation_config.cudagraph_mode == CUDAGraphMode[mode]


def _refusals():  # noqa: ANN202
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode

    full = [pytest.param({"compilation_config": CompilationConfig(
        cudagraph_mode=CUDAGraphMode[m])}, "PIECEWISE", id=m)
        for m in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")]
    return full + [
        pytest.param({"pipeline_parallel_size": 2}, "--pipeline-parallel-size", id="pp"),
        pytest.param({"data_parallel_size": 2}, "--data-parallel-size", id="dp"),
        pytest.param({"decode_context_parallel_size": 2}, "--decode-context-parallel-size",
                     id="dcp"),
        pytest.param({"prefill_context_parallel_size": 2},
                     "--prefill-context-parallel-size", id="pcp"),
        pytest.param({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
                     "--speculative-config", id="spec"),
        pytest.param({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8", id="fp8-kv"),
        pytest.param({"async_scheduling": True}, "--async-scheduling", id="async"),
        pytest.param({"enable_dbo": True}, "--enable-dbo", id="dbo"),
        pytest.param({"long_prefill_token_threshold_adaptive": True},
                     "--long-prefill-token-threshold-adaptive", id="adaptive-prefill-cap"),
        pytest.param({"scheduler_cls": "my.Scheduler"}, "--scheduler-cls", id="scheduler"),
        pytest.param({"worker_cls": "my.Worker"}, "--worker-cls", id="worker"),
    ]


@pytest.mark.parametrize("kwargs, match", _refusals())
def test_refusals_name_the_flag(cuda, kwargs, match) -> None:  # noqa: ANN001
    from nexus_vllm.integration.patches.engine_args import translate_engine_args

    with pytest.raises(ValueError, match="--kv-eviction nexus") as err:
        translate_engine_args(_args(**kwargs))
    assert match in str(err.value)


def test_kv_connector_is_refused(cuda) -> None:  # noqa: ANN001
    from vllm.config import KVTransferConfig

    from nexus_vllm.integration.patches.engine_args import translate_engine_args

    ea = _args(kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector",
                                                   kv_role="kv_both"))
    with pytest.raises(ValueError, match="--kv-transfer-config"):
        translate_engine_args(ea)


@pytest.mark.parametrize("attr, value, match", [
    ("sliding", 4096, "sliding-window attention"),
    ("uses_alibi", True, "ALiBi"),
    ("use_mla", True, "MLA"),
    ("is_hybrid", True, "hybrid"),
    ("is_encoder_decoder", True, "encoder-decoder"),
    ("is_mm_prefix_lm", True, "multimodal prefixes"),
    ("rswa_window", 512, "reference sliding-window"),
])
def test_model_refusals(attr, value, match) -> None:  # noqa: ANN001
    from nexus_vllm.core import EvictionConfig
    from nexus_vllm.integration.patches.engine_args import check_model_config

    model = SimpleNamespace(model="m", uses_alibi=False, use_mla=False, is_hybrid=False,
                            is_encoder_decoder=False, is_mm_prefix_lm=False, rswa_window=None,
                            sliding=None)
    setattr(model, attr, value)
    model.get_sliding_window = lambda: model.sliding
    cfg = EvictionConfig(method="nexus", max_tokens=1024)
    with pytest.raises(ValueError, match=match):
        check_model_config(SimpleNamespace(model_config=model), cfg)


def test_cli_refusal_is_one_clean_line(cuda) -> None:  # noqa: ANN001
    """From ``vllm serve`` a refusal exits with one line naming the flag (no traceback)."""
    ea = _args(pipeline_parallel_size=2)
    ea._nexus_from_cli = True
    import nexus_vllm

    nexus_vllm.register()
    with pytest.raises(SystemExit, match="vllm serve: error: .*--pipeline-parallel-size"):
        ea.create_engine_config()
