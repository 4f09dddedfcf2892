"""Startup of an evicting server: the engine policy on plain values
(``integration/engine_policy``), then through vLLM's ``EngineArgs`` on a pretend CUDA
platform: PIECEWISE graphs, the model runner vLLM picks, and every refusal with its
message (no GPU, no server; a few seconds)."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest

from nexus_vllm.core import EvictionConfig
from nexus_vllm.integration.compat.attention_traits import AttentionTraits, unsupported_attention
from nexus_vllm.integration.frontend.engine_policy import (
    ASYNC_SCHEDULER_CLS,
    REFUSALS,
    SCHEDULER_CLS,
    WORKER_CLS,
    EngineSettings,
    check_engine_settings,
    check_model,
    forced_cudagraph_mode,
    forced_engine_args,
    restate_vllm_refusal,
    scheduler_cls_for,
    with_engine_block_size,
)
from tests.integration.conftest import HAS_VLLM
from tests.integration.test_config import LOCAL_MODEL

needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

NEXUS = {"nexus": {"method": "nexus", "max_tokens": 1024}}
CFG = EvictionConfig(method="nexus", max_tokens=1024)


# -- the engine policy on plain values (no vLLM) -------------------------------------------
def test_default_settings_pass_on_cpu_and_gpu() -> None:
    check_engine_settings("nexus", EngineSettings())
    check_engine_settings("nexus", EngineSettings(on_cpu=False, cudagraph_mode="PIECEWISE"))


# (settings, the whole "what ... ; instead" of the refusal, after "--kv-eviction h2o: ")
SETTING_REFUSALS = [
    (EngineSettings(decode_context_parallel_size=2), "--decode-context-parallel-size > 1 "
     "is not supported with eviction; use --tensor-parallel-size or "
     "--pipeline-parallel-size to shard a model (every rank then applies the same "
     "evictions)"),
    (EngineSettings(prefill_context_parallel_size=2), "--prefill-context-parallel-size > 1"),
    (EngineSettings(long_prefill_token_threshold_adaptive=True),
     "--long-prefill-token-threshold-adaptive is not supported with eviction; drop the flag"),
    (EngineSettings(enable_dbo=True), "--enable-dbo (dual-batch overlap) is not supported"),
    (EngineSettings(speculative=True), "--speculative-config (speculative decoding) is not "
     "supported with eviction; serve without a draft model"),
    (EngineSettings(kv_cache_dtype="fp8_e4m3"), "--kv-cache-dtype fp8_e4m3 (a quantized KV "
     "cache) is not supported with eviction; use --kv-cache-dtype auto"),
    (EngineSettings(kv_connector=True), "--kv-transfer-config (a KV connector) is not "
     "supported with eviction; serve without a KV connector"),
    (EngineSettings(scheduler_cls="my.Scheduler"), "--scheduler-cls my.Scheduler is not "
     "supported with eviction; eviction replaces the scheduler"),
    (EngineSettings(worker_cls="my.Worker"), "--worker-cls my.Worker is not supported"),
    (EngineSettings(on_cpu=False, cudagraph_mode="FULL_AND_PIECEWISE", full_cudagraphs=True),
     "cudagraph_mode FULL_AND_PIECEWISE is not supported with eviction; eviction reads "
     "each step's queries inside attention"),
]


@pytest.mark.parametrize("settings, message", SETTING_REFUSALS,
                         ids=[m.split(" ")[0] for _, m in SETTING_REFUSALS])
def test_each_setting_refusal_names_the_flag(settings, message) -> None:  # noqa: ANN001
    with pytest.raises(ValueError) as err:
        check_engine_settings("h2o", settings)
    assert str(err.value).startswith(f"--kv-eviction h2o: {message}"), str(err.value)


def test_every_refusal_is_exercised() -> None:
    """Each function in REFUSALS refuses one of the settings above, and only that one."""
    for refuse in REFUSALS:
        refused = [s for s, _ in SETTING_REFUSALS if refuse(s) is not None]
        assert refused, f"{refuse.__name__} refuses none of SETTING_REFUSALS"
        assert refuse(EngineSettings()) is None


def test_full_cudagraphs_are_refused_on_gpu_only() -> None:
    full = {"cudagraph_mode": "FULL", "full_cudagraphs": True}
    check_engine_settings("nexus", EngineSettings(on_cpu=True, **full))  # no CUDA graphs
    with pytest.raises(ValueError, match="cudagraph_mode FULL is not supported"):
        check_engine_settings("nexus", EngineSettings(on_cpu=False, **full))


def test_data_and_pipeline_parallelism_are_allowed() -> None:
    """Each DP rank's engine core schedules and evicts on its own (issue 21); every
    pipeline stage applies the same plans and the last one replies (issue 29)."""
    check_engine_settings("nexus", EngineSettings(data_parallel_size=2))
    check_engine_settings("nexus", EngineSettings(pipeline_parallel_size=2))
    check_engine_settings("nexus", EngineSettings(pipeline_parallel_size=4, on_cpu=False))


def test_the_scheduler_follows_the_scheduling_vllm_settles_on() -> None:
    assert scheduler_cls_for(False) == SCHEDULER_CLS
    assert scheduler_cls_for(True) == ASYNC_SCHEDULER_CLS


def test_settings_refuse_a_parallel_size_below_one() -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1; got 0"):
        EngineSettings(data_parallel_size=0)


def test_forced_settings() -> None:
    cfg = EvictionConfig(method="nexus", max_tokens=1024, chunk_size=256,
                         prompt_mode="stream")
    assert forced_engine_args(cfg) == {
        "scheduler_cls": SCHEDULER_CLS, "worker_cls": WORKER_CLS, "block_size": 32,
        "enable_chunked_prefill": True, "long_prefill_token_threshold": 256,
        "scheduler_reserve_full_isl": False}
    # The default mode evicts at the prompt's end only: vLLM chunks the prompt itself.
    end = EvictionConfig(method="nexus", max_tokens=1024, chunk_size=256)
    assert "long_prefill_token_threshold" not in forced_engine_args(end)
    assert with_engine_block_size(cfg, None) is cfg
    assert with_engine_block_size(cfg, 32) is cfg
    assert with_engine_block_size(cfg, 16).block_size == 16  # vLLM's --block-size wins
    assert forced_engine_args(with_engine_block_size(cfg, 16))["block_size"] == 16
    assert forced_cudagraph_mode(EngineSettings(on_cpu=False)) == "PIECEWISE"
    assert forced_cudagraph_mode(EngineSettings(on_cpu=False, cudagraph_mode="NONE")) is None
    assert forced_cudagraph_mode(EngineSettings(on_cpu=True)) is None


def test_vllm_chunk_size_refusal_is_restated() -> None:
    vllm_text = ("1 validation error for SchedulerConfig\n  Value error, "
                 "long_prefill_token_threshold (8192) cannot be greater than the "
                 "max_model_len (4096). [type=value_error]")
    assert restate_vllm_refusal("snapkv", vllm_text) == (
        "--kv-eviction snapkv: --kv-chunk-size 8192 is above --max-model-len 4096; "
        "allowed: 1..4096 tokens")
    assert restate_vllm_refusal("snapkv", "max_model_len (4096) is too large") is None


def test_every_attention_trait_has_a_refusal() -> None:
    assert unsupported_attention(AttentionTraits()) == []
    names = [f.name for f in fields(AttentionTraits)]
    texts = [unsupported_attention(AttentionTraits(**{name: True})) for name in names]
    assert all(len(t) == 1 for t in texts), texts
    assert len({t[0] for t in texts}) == len(names)  # each named its own way
    both = unsupported_attention(AttentionTraits(alibi=True, encoder_decoder=True))
    assert both == [*unsupported_attention(AttentionTraits(alibi=True)),
                    *unsupported_attention(AttentionTraits(encoder_decoder=True))]


def test_check_model_names_the_model_then_the_limits() -> None:
    with pytest.raises(ValueError, match="^--kv-eviction nexus: model m uses ALiBi position "
                                         "biases .* and an encoder-decoder architecture;"):
        check_model(CFG, "m", AttentionTraits(alibi=True, encoder_decoder=True), 4096, 4)
    check_model(CFG, "m", AttentionTraits(), 4096, 4)
    with pytest.raises(ValueError, match="^--kv-eviction nexus: --kv-budget 1024 is above "
                                         "--max-model-len 512"):
        check_model(CFG, "m", AttentionTraits(), 512, 4)
    with pytest.raises(ValueError, match="^--kv-eviction nexus: nexus.skip_layers 2 leaves "
                                         "no layer to score: the model has 2 layers"):
        check_model(CFG, "m", AttentionTraits(), 4096, 2)


def test_check_model_refuses_head_granularity_naming_the_field() -> None:
    heads = CFG.replace(granularity="head")
    with pytest.raises(ValueError, match="^--kv-eviction nexus: nexus.granularity 'head' is "
                                         "not served yet"):
        check_model(heads, "m", AttentionTraits(), 4096, 4)


# -- through vLLM's EngineArgs on a pretend CUDA platform ---------------------------------
@pytest.fixture
def cuda(monkeypatch):  # noqa: ANN001, ANN201
    """``current_platform`` answers like a CUDA box; the V2-runner switch is unset."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    return monkeypatch


@needs_vllm
def test_the_runner_vllm_picks_is_kept(cuda) -> None:  # noqa: ANN001
    """Evicting servers run on whatever model runner vLLM picks (every family has an
    adapter): nothing forces or refuses Model Runner V2."""
    import os

    from nexus_vllm.integration.frontend.patches.engine_args import translate_engine_args

    cuda.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert translate_engine_args(_args()) is not None
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    cuda.delenv("VLLM_USE_V2_MODEL_RUNNER")
    assert translate_engine_args(_args()) is not None
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


def _args(**kw):  # noqa: ANN003, ANN202
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(model=LOCAL_MODEL, additional_config=dict(NEXUS), **kw)


@needs_vllm
def test_piecewise_graphs_are_set(cuda) -> None:  # noqa: ANN001
    from vllm.config.compilation import CUDAGraphMode

    from nexus_vllm.integration.frontend.patches.engine_args import translate_engine_args

    ea = _args(tensor_parallel_size=2)  # tensor parallelism is allowed
    assert translate_engine_args(ea) is not None
    assert ea.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    # Async scheduling is vLLM's to decide (match_scheduler then picks our class).
    assert ea.async_scheduling is None and ea.enable_chunked_prefill is True
    assert ea.worker_cls == "nexus_vllm.integration.worker.worker.NexusWorker"


@needs_vllm
@pytest.mark.parametrize("asked", [None, True, False])
def test_the_scheduler_class_matches_the_scheduling_vllm_chose(asked, tiny_model) -> None:  # noqa: ANN001
    """On the CPU platform vLLM turns async scheduling off whatever was asked: the
    engine then runs our synchronous scheduler; where vLLM keeps it on (its default on
    CUDA from 0.34), match_scheduler picks the async one."""
    import nexus_vllm
    from nexus_vllm.integration.frontend.patches.engine_args import match_scheduler

    nexus_vllm.register()
    from vllm.engine.arg_utils import AsyncEngineArgs

    config = AsyncEngineArgs(model=tiny_model, additional_config=dict(NEXUS),
                             async_scheduling=asked).create_engine_config()
    assert config.scheduler_config.async_scheduling is False
    assert config.scheduler_config.scheduler_cls == SCHEDULER_CLS
    assert config.scheduler_config.get_scheduler_cls().__name__ == "NexusScheduler"
    config.scheduler_config.async_scheduling = True
    match_scheduler(config)
    assert config.scheduler_config.get_scheduler_cls().__name__ == "NexusAsyncScheduler"


@needs_vllm
@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE"])
def test_explicit_non_full_modes_are_kept(cuda, mode) -> None:  # noqa: ANN001
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode

    from nexus_vllm.integration.frontend.patches.engine_args import translate_engine_args

    ea = _args(compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode[mode]))
    translate_engine_args(ea)
    assert ea.compilation_config.cudagraph_mode == CUDAGraphMode[mode]


def _refusals():  # noqa: ANN202
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode

    full = [pytest.param({"compilation_config": CompilationConfig(
        cudagraph_mode=CUDAGraphMode[m])}, "PIECEWISE", id=m)
        for m in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")]
    return full + [
        pytest.param({"decode_context_parallel_size": 2}, "--decode-context-parallel-size",
                     id="dcp"),
        pytest.param({"prefill_context_parallel_size": 2},
                     "--prefill-context-parallel-size", id="pcp"),
        pytest.param({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
                     "--speculative-config", id="spec"),
        pytest.param({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8", id="fp8-kv"),
        pytest.param({"enable_dbo": True}, "--enable-dbo", id="dbo"),
        pytest.param({"long_prefill_token_threshold_adaptive": True},
                     "--long-prefill-token-threshold-adaptive", id="adaptive-prefill-cap"),
        pytest.param({"scheduler_cls": "my.Scheduler"}, "--scheduler-cls", id="scheduler"),
        pytest.param({"worker_cls": "my.Worker"}, "--worker-cls", id="worker"),
    ]


@needs_vllm
@pytest.mark.parametrize("kwargs, match", _refusals() if HAS_VLLM else [])
def test_refusals_name_the_flag(cuda, kwargs, match) -> None:  # noqa: ANN001
    from nexus_vllm.integration.frontend.patches.engine_args import translate_engine_args

    with pytest.raises(ValueError, match="--kv-eviction nexus") as err:
        translate_engine_args(_args(**kwargs))
    assert match in str(err.value)


@needs_vllm
def test_kv_connector_is_refused(cuda) -> None:  # noqa: ANN001
    from vllm.config import KVTransferConfig

    from nexus_vllm.integration.frontend.patches.engine_args import translate_engine_args

    ea = _args(kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector",
                                                   kv_role="kv_both"))
    with pytest.raises(ValueError, match="--kv-transfer-config"):
        translate_engine_args(ea)


@needs_vllm
@pytest.mark.parametrize("attr, value, match", [
    ("sliding", 4096, "sliding-window attention in every layer"),
    ("uses_alibi", True, "ALiBi"),
    ("is_hybrid", True, "hybrid"),
    ("is_encoder_decoder", True, "encoder-decoder"),
    ("is_mm_prefix_lm", True, "multimodal prefixes"),
    ("rswa_window", 512, "reference sliding-window"),
])
def test_model_refusals(attr, value, match) -> None:  # noqa: ANN001
    from nexus_vllm.integration.frontend.patches.engine_args import check_model_config

    check_model_config(_vllm_config(_model()), CFG)
    model = _model(**{attr: value})
    with pytest.raises(ValueError, match=f"^--kv-eviction nexus: model m uses .*{match}"):
        check_model_config(_vllm_config(model), CFG)


def _vllm_config(model, hybrid_manager: bool = True):  # noqa: ANN001, ANN202
    scheduler = SimpleNamespace(disable_hybrid_kv_cache_manager=not hybrid_manager)
    return SimpleNamespace(model_config=model, scheduler_config=scheduler)


_INTERLEAVED = ["sliding_attention"] * 5 + ["full_attention"]


@needs_vllm
def test_interleaved_sliding_window_needs_the_hybrid_manager() -> None:
    """Gemma 3's interleaved sliding-window layers evict through vLLM's hybrid KV cache
    manager (the full-attention group only); with the manager off the model is refused,
    naming the flag that turned it off."""
    from nexus_vllm.integration.frontend.patches.engine_args import check_model_config

    gemma = _model(sliding=512, hf_text_config=SimpleNamespace(
        num_hidden_layers=6, layer_types=_INTERLEAVED))
    check_model_config(_vllm_config(gemma), CFG)
    with pytest.raises(ValueError, match="hybrid KV cache manager is off.*"
                                         "--disable-hybrid-kv-cache-manager"):
        check_model_config(_vllm_config(gemma, hybrid_manager=False), CFG)
    every = _model(sliding=512, hf_text_config=SimpleNamespace(
        num_hidden_layers=6, layer_types=["sliding_attention"] * 6))
    with pytest.raises(ValueError, match="sliding-window attention in every layer"):
        check_model_config(_vllm_config(every), CFG)


def _model(**traits):  # noqa: ANN003, ANN202
    """A stand-in for vLLM's ``ModelConfig`` with every attention feature off."""
    off = {"uses_alibi": False, "use_mla": False, "is_hybrid": False,
           "is_encoder_decoder": False, "is_mm_prefix_lm": False, "rswa_window": None,
           "sliding": None, "hf_text_config": SimpleNamespace(num_hidden_layers=4)}
    model = SimpleNamespace(model="m", max_model_len=4096, **{**off, **traits})
    model.get_sliding_window = lambda: model.sliding
    return model


def _layer(**attrs):  # noqa: ANN003, ANN202
    """A stand-in for vLLM's ``Attention`` layer: decoder self-attention, full window."""
    from vllm.v1.attention.backend import AttentionType

    base = {"attn_type": AttentionType.DECODER, "sliding_window": None,
            "kv_sharing_target_layer_name": None, "impl": SimpleNamespace(alibi_slopes=None)}
    return SimpleNamespace(**{**base, **attrs})


@needs_vllm
def test_layers_and_models_share_one_check() -> None:
    """The worker's per-layer check and the startup model check read the same traits
    through the same :func:`unsupported_attention`, so they name a feature alike."""
    from vllm.v1.attention.backend import AttentionType

    from nexus_vllm.integration.compat.vllm_compat import AttentionLayerView, model_attention_traits

    assert model_attention_traits(_model()) == AttentionTraits()
    assert AttentionLayerView("l0", _layer()).unsupported_reason() is None
    assert model_attention_traits(_model(sliding=4096)) == AttentionTraits(
        sliding_window_only=True)
    # A sliding layer is checked with its KV cache group (group_role), not alone.
    windowed = AttentionLayerView("l0", _layer(sliding_window=4096))
    assert windowed.unsupported_reason() is None and windowed.sliding_window == 4096
    alibi = _layer(impl=SimpleNamespace(alibi_slopes=[0.5]))
    assert AttentionLayerView("l0", alibi).attention_traits() == AttentionTraits(alibi=True)
    assert model_attention_traits(_model(uses_alibi=True)) == AttentionTraits(alibi=True)
    shared = _layer(kv_sharing_target_layer_name="l0", attn_type=AttentionType.ENCODER)
    assert AttentionLayerView("l1", shared).attention_traits() == AttentionTraits(
        non_decoder_attention=True, shared_kv_cache=True)


@needs_vllm
def test_cli_refusal_is_one_clean_line(cuda) -> None:  # noqa: ANN001
    """From ``vllm serve`` a refusal exits with one line naming the flag (no traceback)."""
    ea = _args(decode_context_parallel_size=2)
    ea._nexus_from_cli = True
    import nexus_vllm

    nexus_vllm.register()
    with pytest.raises(SystemExit,
                       match="vllm serve: error: .*--decode-context-parallel-size"):
        ea.create_engine_config()
