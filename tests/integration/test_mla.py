"""Multi-head latent attention (MLA) without a server: the latent queries and keys the
scorer reads (``integration/worker/mla.py``), the KV cache group, and what an MLA model
cannot run with on vLLM's CPU platform (startup and per request). The served path is
``test_e2e_mla.py``."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nexus_vllm.core import EvictionConfig
from nexus_vllm.core.scoring import block_attention_mass
from nexus_vllm.integration.frontend.engine_policy import LatentAttention, check_latent_attention
from nexus_vllm.integration.frontend.request_args import RequestArgError, validate_request_args
from tests.integration.conftest import HAS_VLLM
from tests.integration.test_bad_input import serve_parser, vllm_process_state  # noqa: F401

needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

# A small MLA shape: N heads, latent L, rotary R, non-rotary query/key part P.
N, L, R, P = 3, 16, 8, 6


def _mla_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_UK`` ``[L, N, P]`` (vLLM's split of ``kv_b_proj``) and ``W_UK_T`` ``[N, P, L]``
    (``MLAAttention.process_weights_after_loading``: ``W_UK.permute(1, 2, 0)``)."""
    g = torch.Generator().manual_seed(seed)
    w_uk = torch.randn(L, N, P, generator=g, dtype=torch.float64)
    return w_uk, w_uk.permute(1, 2, 0)


def test_absorbed_query_against_latent_rows_gives_mla_logits() -> None:
    """The latent query (``q_nope @ W_UK_T`` then ``q_pe``) against the cached latent row
    (``c_kv`` then ``k_pe``) is each head's un-absorbed logit ``q . [W_UK c_kv, k_pe]``:
    what prefill attention computes, so prompt queries score as decode queries do."""
    from nexus_vllm.integration.worker.mla import absorbed_query, latent_rows

    w_uk, w_uk_t = _mla_weights()
    g = torch.Generator().manual_seed(1)
    t = 11
    c_kv = torch.randn(t, L, generator=g, dtype=torch.float64)
    k_pe = torch.randn(t, 1, R, generator=g, dtype=torch.float64)
    q = torch.randn(4, N, P + R, generator=g, dtype=torch.float64)
    k_nope = torch.einsum("tl,lnp->tnp", c_kv, w_uk)  # [T, N, P]
    keys = torch.cat([k_nope, k_pe.expand(t, N, R)], dim=-1)  # each head's own keys
    want = torch.einsum("qnd,tnd->qnt", q, keys)
    rows = latent_rows(c_kv, k_pe)
    assert rows.shape == (t, 1, L + R)
    assert torch.equal(rows[:, 0, :L], c_kv) and torch.equal(rows[:, 0, L:], k_pe[:, 0])
    got = torch.einsum("qnd,td->qnt", absorbed_query(q, w_uk_t, P), rows[:, 0])
    torch.testing.assert_close(got, want)


def test_scaled_latent_query_scores_with_mla_softmax() -> None:
    """The ring holds latent queries times ``scale * sqrt(D)``: the scorer's softmax at
    ``1 / sqrt(D)`` over one shared KV head is then MLA's softmax at ``scale``."""
    from nexus_vllm.integration.worker.mla import latent_key_view

    g = torch.Generator().manual_seed(2)
    t, d, scale, block = 40, L + R, 1.0 / math.sqrt(P + R), 8
    latent_q = torch.randn(3, N, d, generator=g)
    cache = torch.randn(t // block, block, d, generator=g)  # [blocks, block, latent]
    keys = latent_key_view(cache)
    assert keys.shape == (t // block, 1, block, d)
    rows = keys.permute(0, 2, 1, 3).reshape(t, 1, d)
    got = block_attention_mass(latent_q * (scale * math.sqrt(d)), rows, block)
    logits = torch.einsum("wnd,td->nwt", latent_q, rows[:, 0]) * scale
    logits = logits.masked_fill(torch.arange(t)[None, :] > torch.arange(t - 3, t)[:, None],
                                float("-inf"))
    want = torch.softmax(logits, -1).view(N, 3, t // block, block).sum(-1).mean(0)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="num_blocks, block_size, latent"):
        latent_key_view(keys)


def test_latent_rotary_turns_the_rotary_channels_only() -> None:
    """Expected attention un-rotates captured queries: on a latent query only ``q_pe``
    (the last channels) carries a position; the absorbed part is left as it is."""
    from nexus_vllm.core import Rotary
    from nexus_vllm.integration.worker.mla import latent_rotary

    rope = Rotary.from_inv_freq(1.0 / (1e4 ** (torch.arange(0, R, 2) / R)), 64, head_size=R,
                                neox=False)
    lat = latent_rotary(rope, L + R)
    assert (lat.head_size, lat.offset, lat.rot_dim) == (L + R, L, R)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(5, N, L + R, generator=g)
    pos = torch.arange(10, 15)
    got = lat.unrotate(q, pos)
    assert torch.equal(got[..., :L], q[..., :L])
    torch.testing.assert_close(got[..., L:], rope.unrotate(q[..., L:], pos))
    mean = lat.mean_rotation(torch.tensor([7]), 4)[0]
    torch.testing.assert_close(mean[L:, L:], rope.mean_rotation(torch.tensor([7]), 4)[0])
    assert torch.equal(mean[:L, :L], torch.eye(L)) and not mean[:L, L:].any()


class _Ring:
    """The query ring's side the MLA hook touches."""

    def __init__(self, layer: int) -> None:
        self.step_capture = object()
        self.ring_layer = {layer: 0}
        self.captured: list[tuple[int, torch.Tensor]] = []
        self.checked: list[tuple[int, torch.Tensor]] = []

    def capture(self, layer: int, query: torch.Tensor) -> None:
        self.captured.append((layer, query))

    def check_keys(self, layer: int, key: torch.Tensor) -> None:
        self.checked.append((layer, key))


class _StockImpl:
    """Stands in for vLLM's MLA impl: records the calls ``forward_impl`` makes."""

    scale = 0.25
    qk_nope_head_dim = P

    def __init__(self) -> None:
        self.calls: list[str] = []

    def forward_mha(self, q, kv_c_normed, k_pe, cache, md, k_scale, output,  # noqa: ANN001
                    output_scale=None) -> None:  # noqa: ANN001
        self.calls.append("mha")

    def forward_mqa(self, q, cache, md, layer):  # noqa: ANN001, ANN201
        self.calls.append("mqa")
        return "out", None

    def do_kv_cache_update(self, kv_c_normed, k_pe, cache, slots, dtype, k_scale) -> None:  # noqa: ANN001
        self.calls.append("write")


def _impl(layer: int = 5):  # noqa: ANN202
    from nexus_vllm.integration.worker.mla import NexusMLAImplMixin

    class Impl(NexusMLAImplMixin, _StockImpl):
        pass

    impl = Impl()
    _, w_uk_t = _mla_weights()
    impl.nexus_ring = _Ring(layer)  # type: ignore[assignment]
    impl.nexus_layer = layer
    impl.nexus_mla_layer = SimpleNamespace(W_UK_T=w_uk_t.float())
    return impl


def test_hook_captures_decode_rows_then_prompt_rows_in_batch_order() -> None:
    """``forward_impl`` calls ``forward_mha`` (prompt tokens, un-absorbed) before
    ``forward_mqa`` (decode tokens, absorbed); the batch puts decodes first. The ring gets
    one ``[tokens, N, L + R]`` query in batch order, scaled for the scorer, and the stock
    calls run unchanged."""
    from nexus_vllm.integration.worker.mla import absorbed_query

    impl = _impl()
    _, w_uk_t = _mla_weights()
    g = torch.Generator().manual_seed(3)
    q_prompt = torch.randn(4, N, P + R, generator=g)
    ql_nope, q_pe = torch.randn(2, N, L, generator=g), torch.randn(2, N, R, generator=g)
    md = SimpleNamespace(num_decode_tokens=2)
    impl.forward_mha(q_prompt, None, None, None, md, None, None)
    assert impl.nexus_ring.captured == []  # waits for the decode part
    assert impl.forward_mqa((ql_nope, q_pe), None, md, None) == ("out", None)
    assert impl.calls == ["mha", "mqa"]
    ((layer, got),) = impl.nexus_ring.captured
    factor = _StockImpl.scale * math.sqrt(L + R)
    want = torch.cat([torch.cat([ql_nope, q_pe], -1),
                      absorbed_query(q_prompt, w_uk_t.float(), P)]) * factor
    assert layer == 5 and got.shape == (6, N, L + R)
    torch.testing.assert_close(got, want)

    # A prompt-only batch is captured at forward_mha; a decode-only one at forward_mqa.
    impl.forward_mha(q_prompt, None, None, None, SimpleNamespace(num_decode_tokens=0), None,
                     None)
    assert impl.nexus_ring.captured[-1][1].shape == (4, N, L + R)
    impl.forward_mqa(torch.cat([ql_nope, q_pe], -1), None, md, None)
    assert impl.nexus_ring.captured[-1][1].shape == (2, N, L + R)


def test_hook_is_idle_for_unscored_layers_and_between_steps() -> None:
    impl = _impl(layer=5)
    impl.nexus_layer = 1  # not a scored layer
    q = torch.zeros(2, N, P + R)
    impl.forward_mha(q, None, None, None, SimpleNamespace(num_decode_tokens=0), None, None)
    impl.nexus_layer = 5
    impl.nexus_ring.step_capture = None  # no step armed (warm-up, profiling)
    impl.forward_mha(q, None, None, None, SimpleNamespace(num_decode_tokens=0), None, None)
    assert impl.nexus_ring.captured == [] and impl.calls == ["mha", "mha"]


def test_key_self_check_sees_the_latent_rows_written() -> None:
    impl = _impl()
    c_kv, k_pe = torch.randn(3, L), torch.randn(3, 1, R)
    impl.do_kv_cache_update(c_kv, k_pe, None, None, "auto", None)
    assert impl.nexus_ring.checked == []  # self-check off
    impl.nexus_self_check = True
    impl.do_kv_cache_update(c_kv, k_pe, None, None, "auto", None)
    ((layer, rows),) = impl.nexus_ring.checked
    assert layer == 5 and torch.equal(rows[:, 0], torch.cat([c_kv, k_pe[:, 0]], -1))
    assert impl.calls == ["write", "write"]


# -- what an MLA model cannot run with (vLLM's CPU platform) -----------------------------
WHOLE_PROMPT = LatentAttention(chunked_prefill=False)
SERVER = EvictionConfig(method="nexus", max_tokens=128, block_size=16)


def test_stream_mode_is_refused_where_prompts_are_not_chunked() -> None:
    stream = SERVER.replace(prompt_mode="stream", chunk_size=64)
    with pytest.raises(ValueError, match="^--kv-eviction nexus: --kv-prompt-mode stream "
                                         "evicts while the prompt is computed.*"
                                         "vllm/platforms/cpu.py.*--kv-prompt-mode end|"
                                         "prompt mode 'end'"):
        check_latent_attention(stream, WHOLE_PROMPT)
    with pytest.raises(ValueError, match="nexus.prefill_budget"):
        check_latent_attention(SERVER.replace(prefill_budget=256), WHOLE_PROMPT)
    check_latent_attention(SERVER, WHOLE_PROMPT)  # end
    check_latent_attention(SERVER.replace(prompt_mode="keep"), WHOLE_PROMPT)
    # Chunked prefill on (a GPU, or CPU with the AMX MLA backend): stream runs (nexus's
    # prompt events read expected attention, refused below).
    check_latent_attention(stream.replace(method="h2o"), LatentAttention(chunked_prefill=True))


@pytest.mark.parametrize("xargs, field", [
    ({"kv_prompt_mode": "stream"}, "kv_prompt_mode"),
    ({"kv_prefill_budget": 512}, "kv_prefill_budget"),
])
def test_per_request_values_an_mla_model_cannot_run_are_refused(xargs, field) -> None:  # noqa: ANN001
    with pytest.raises(RequestArgError, match=f"^vllm_xargs.{field}: .*MLA") as err:
        validate_request_args(xargs, SERVER, max_model_len=4096, latent=WHOLE_PROMPT)
    assert err.value.field == f"vllm_xargs.{field}"
    # Without MLA (or with chunked prefill) the same values are fine.
    validate_request_args(xargs, SERVER, max_model_len=4096)
    for ok in ({"kv_prompt_mode": "end"}, {"kv_eviction": "h2o", "kv_budget": 256},
               {"kv_eviction": "expected"}, {"kv_eviction": "none"}):
        validate_request_args(ok, SERVER, max_model_len=4096, latent=WHOLE_PROMPT)


@needs_vllm
def test_the_latent_cache_is_the_evicted_group() -> None:
    """vLLM's spec for a dense MLA layer (as ``MLAAttention.get_kv_cache_spec`` builds it)
    is a full-attention group; latent caches eviction cannot read as values are not."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from nexus_vllm.integration.compat.vllm_compat import UnsupportedKVCacheGroup, group_role

    shape = {"block_size": 16, "num_kv_heads": 1, "head_size": 576, "dtype": torch.float32}
    assert group_role(MLAAttentionSpec(cache_dtype_str="auto", **shape)) == "evicted"
    with pytest.raises(UnsupportedKVCacheGroup, match="MLAAttentionSpec.*'fp8_ds_mla'"):
        group_role(MLAAttentionSpec(cache_dtype_str="fp8_ds_mla", **shape))


@needs_vllm
def test_eviction_takes_the_block_size_the_platform_forced() -> None:
    """vLLM's CPU platform forces 16-token blocks for MLA after the engine arguments were
    read: the eviction config follows, in ``additional_config`` too."""
    from nexus_vllm.integration.config import ADDITIONAL_CONFIG_KEY, config_from_additional
    from nexus_vllm.integration.frontend.patches.engine_args import (
        adopt_platform_block_size,
        latent_attention,
    )

    cfg = EvictionConfig(method="nexus", max_tokens=128)
    assert cfg.block_size == 32

    def vllm_config(mla: bool):  # noqa: ANN202
        return SimpleNamespace(
            model_config=SimpleNamespace(use_mla=mla), cache_config=SimpleNamespace(block_size=16),
            scheduler_config=SimpleNamespace(enable_chunked_prefill=False),
            additional_config={ADDITIONAL_CONFIG_KEY: cfg.to_dict()})

    vc = vllm_config(mla=True)
    got = adopt_platform_block_size(vc, cfg)
    assert got.block_size == 16 and got.max_tokens == 128
    assert config_from_additional(vc.additional_config) == got
    assert latent_attention(vc) == WHOLE_PROMPT
    plain = vllm_config(mla=False)
    assert adopt_platform_block_size(plain, cfg) is cfg and latent_attention(plain) is None


# -- vLLM's own config for the tiny MLA checkpoint (the platform's limits, measured) -------
@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory):  # noqa: ANN001, ANN201
    from nexus_vllm.hf.tiny_mla import save_tiny_deepseek_v2

    return str(save_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny_mla")))


@pytest.fixture
def mla_build(serve_parser, tiny_mla, vllm_process_state):  # noqa: ANN001, ANN201, F811
    """``vllm serve`` argv -> ``create_engine_config()`` on the tiny MLA checkpoint."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    def build(argv: list[str]) -> object:
        args = serve_parser.parse_args(["--model", tiny_mla, "--max-model-len", "4096",
                                        "--dtype", "float32", *argv])
        return AsyncEngineArgs.from_cli_args(args).create_engine_config()

    return build


@needs_vllm
def test_vllm_cpu_runs_mla_whole_prompt_in_16_token_blocks(mla_build) -> None:
    """What vLLM's CPU platform does to an MLA model on its reference backend (the limits
    the refusals name): chunked prefill and prefix caching off, 16-token blocks. An
    evicting server is pinned to that backend on every CPU, AMX or not; stock serving is
    untouched by the plugin (on a CPU with AMX tiles vLLM picks its AMX kernels, which keep
    chunked prefill)."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU platform only")
    stock = mla_build([])
    assert stock.model_config.use_mla
    assert "nexus" not in (stock.additional_config or {})
    assert stock.attention_config.backend is None  # vLLM's own choice
    reference = mla_build(["--attention-backend", "CPU_MLA"])
    for built in (reference, *([] if torch.cpu._is_amx_tile_supported() else [stock])):
        assert not built.scheduler_config.enable_chunked_prefill
        assert not built.cache_config.enable_prefix_caching
        assert built.cache_config.block_size == 16
    evicting = mla_build(["--kv-eviction", "nexus", "--kv-budget", "128"])  # end mode
    assert evicting.attention_config.backend.name == "CPU_MLA"
    assert not evicting.scheduler_config.enable_chunked_prefill
    assert evicting.cache_config.block_size == 16
    assert evicting.additional_config["nexus"]["block_size"] == 16
    assert evicting.scheduler_config.scheduler_cls.endswith("NexusScheduler")


@needs_vllm
@pytest.mark.parametrize("argv, named", [
    (["--kv-prompt-mode", "stream"], "--kv-prompt-mode stream evicts while the prompt is "
                                     "computed"),
    (["--kv-prefill-budget", "512"], "nexus.prefill_budget evicts while the prompt is "
                                     "computed"),
])
def test_mla_startup_refusals_name_the_limit(mla_build, argv, named) -> None:  # noqa: ANN001
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU platform only")
    with pytest.raises(SystemExit) as err:
        mla_build(["--kv-eviction", "nexus", "--kv-budget", "128", *argv])
    msg = str(err.value)
    assert msg.startswith("vllm serve: error: --kv-eviction ") and "\n" not in msg, msg
    assert named in msg, msg
    assert "turns chunked prefill off (vllm/platforms/cpu.py" in msg, msg


# -- canaries: the vLLM internals the MLA path relies on (vllm_compat's inventory) --------
@needs_vllm
def test_mla_internals_canary() -> None:
    """``forward_impl`` runs the prompt tokens (``forward_mha``, un-absorbed) before the
    decode tokens (``forward_mqa``, absorbed with ``W_UK_T``); the impl methods the mixin
    overrides keep their leading parameters; the layer's cache is ``[blocks, block,
    latent]``; the spec fields ``group_role`` reads exist."""
    import inspect

    from vllm.model_executor.layers.attention.mla_attention import (
        MLAAttention,
        MLACommonImpl,
    )
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    src = inspect.getsource(MLAAttention.forward_impl)
    assert src.index("self.impl.forward_mha(") < src.index("self.impl.forward_mqa(")
    assert "num_decode_tokens" in src
    # 0.32 absorbs in forward_impl, 0.34 in _prepare_mqa_query: W_UK_T either way.
    assert "torch.bmm(mqa_q_nope, W_UK_T" in inspect.getsource(MLAAttention)
    assert '"W_UK_T"' in inspect.getsource(MLAAttention.process_weights_after_loading)
    assert "squeeze(1)" in inspect.getsource(MLAAttention.bind_kv_cache)
    assert "self.impl.do_kv_cache_update(" in inspect.getsource(MLAAttention)

    def params(fn: Any) -> list[str]:
        return list(inspect.signature(fn).parameters)[1:]

    assert params(MLACommonImpl.forward_mha)[:5] == [
        "q", "kv_c_normed", "k_pe", "kv_c_and_k_pe_cache", "attn_metadata"]
    assert params(CPUMLAImpl.forward_mqa)[:3] == ["q", "kv_c_and_k_pe_cache", "attn_metadata"]
    assert params(CPUMLAImpl.do_kv_cache_update)[:3] == ["kv_c_normed", "k_pe", "kv_cache"]
    for name in ("cache_dtype_str", "model_version", "is_index_group_leader",
                 "state_content_bytes"):
        assert hasattr(MLAAttentionSpec, name) or name in MLAAttentionSpec.__dataclass_fields__
