"""``nexus-vllm size``: the arithmetic by hand, the prediction against the CPU measurement,
and hybrid sliding-window models group by group (against vLLM's own functions when vLLM is
installed)."""

import itertools
import json
import pathlib
import subprocess
import sys

import pytest

from nexus_vllm.core import ConfigError, EvictionConfig
from nexus_vllm.sizing import (
    BUILTIN_CONFIGS,
    BUILTIN_MODELS,
    KVGroup,
    block_bytes_per_gpu,
    eviction_refusal,
    kv_cache_groups,
    kv_pool_blocks,
    main,
    mla_param_count,
    model_shape,
    page_bytes_per_layer,
    param_count,
    pp_stages,
    simulate_burst,
    split_context,
    stock_admission_blocks,
    window_allowance,
    window_held_blocks,
    window_max_blocks,
)
from tests.script_module import load_script

REPO = pathlib.Path(__file__).resolve().parents[1]
MEASURED = REPO / "docs" / "figures" / "serving_modes" / "capacity.json"
LLAMA_8B = BUILTIN_MODELS["llama-3.1-8b"]


def _size(capsys, *flags: str) -> dict:
    assert main([*flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# The capacity benchmark's CPU run: --num-gpu-blocks-override 133, 32-token blocks, 2048 +
# 32 tokens (--max-model-len 2112), --kv-budget 416, --kv-chunk-size 64, max-num-seqs 8,
# vLLM's CPU token budget 2048 a step.
CPU_RUN = ("--model", "llama-3.1-8b", "--pool-blocks", "133", "--block-size", "32",
           "--context", "2112", "--budget", "416", "--chunk-size", "64",
           "--max-num-seqs", "12", "--max-num-batched-tokens", "2048")
# The paper's streaming mode (the server's default is end).
STREAM_RUN = (*CPU_RUN, "--prompt-mode", "stream")


# -- the model -------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "params"), [
    ("llama-3.1-8b", 8_030_261_248), ("llama-3.1-70b", 70_553_706_496),
    ("qwen2.5-72b", 72_706_203_648)])
def test_builtin_parameter_counts_match_the_published_models(name, params):
    assert param_count(BUILTIN_CONFIGS[name]) == params
    assert BUILTIN_MODELS[name].weight_bytes == 2 * params  # bf16


def test_builtin_shapes():
    for name, layers in (("llama-3.1-8b", 32), ("llama-3.1-70b", 80), ("qwen2.5-72b", 80)):
        m = BUILTIN_MODELS[name]
        assert (m.layers, m.kv_heads, m.head_size, m.dtype) == (layers, 8, 128, "bfloat16")


def test_config_path_reads_the_shape_and_estimates_weights(tmp_path):
    cfg = {k: v for k, v in BUILTIN_CONFIGS["llama-3.1-8b"].items() if k != "head_dim"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = model_shape(str(tmp_path))
    # head_dim falls back to hidden_size / num_attention_heads = 4096 / 32.
    assert (m.layers, m.kv_heads, m.head_size) == (32, 8, 128)
    assert m.weight_bytes == 16_060_522_496 and m.weight_source.startswith("estimated")


def test_config_path_prefers_the_safetensors_index(tmp_path):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
           "intermediate_size": 512, "vocab_size": 1000, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 123456}}))
    m = model_shape(str(tmp_path / "config.json"))
    # num_key_value_heads falls back to num_attention_heads; head 256 / 4.
    assert (m.kv_heads, m.head_size, m.dtype_bytes) == (4, 64, 2)
    assert m.weight_bytes == 123456 and "total_size" in m.weight_source


# -- blocks ----------------------------------------------------------------------------
@pytest.mark.parametrize(("tp", "pp", "expected"), [
    (1, 1, 2_097_152),  # 2 x 32 layers x 8 heads x 128 x 2 B x 16 tokens
    (2, 1, 1_048_576),  # 2 x 32 x 4 heads (8 / 2) x 128 x 2 x 16
    (8, 1, 262_144),    # 2 x 32 x 1 head x 128 x 2 x 16
    (16, 1, 262_144),   # tp 16 > 8 KV heads: one head per GPU, replicated
    (1, 2, 1_048_576),  # 2 x 16 layers (32 / 2) x 8 x 128 x 2 x 16
    (1, 3, 720_896),    # 2 x 11 layers (ceil 32 / 3, the largest stage) x 8 x 128 x 2 x 16
])
def test_block_bytes_per_gpu(tp, pp, expected):
    assert block_bytes_per_gpu(LLAMA_8B, tp=tp, pp=pp, block_size=16) == expected


def test_pool_blocks_by_hand():
    got = kv_pool_blocks(LLAMA_8B, gpu_memory_gib=80, gpu_util=0.9, overhead_gib=4, tp=1,
                         pp=1, block_size=16)
    # 80 GiB x 0.9 = 77_309_411_328 B; - 16_060_522_496 weights - 4_294_967_296 overhead
    # = 56_953_921_536 B; / 2_097_152 B a block = 27157.8 -> 27157 blocks.
    assert got["pool_blocks"] == 27157
    # tp=2: weights 8_030_261_248 per GPU; 77_309_411_328 - 8_030_261_248 - 4_294_967_296
    # = 64_984_182_784 B; / 1_048_576 = 61973.4 -> 61973.
    got = kv_pool_blocks(LLAMA_8B, gpu_memory_gib=80, gpu_util=0.9, overhead_gib=4, tp=2,
                         pp=1, block_size=16)
    assert got["pool_blocks"] == 61973


def test_pool_blocks_through_the_command_line(capsys):
    out = _size(capsys, "--model", "llama-3.1-8b", "--gpu-memory-gib", "80", "--context",
                "8192", "--budget", "0.2")
    assert out["pool_blocks"] == 27157 and out["usable_blocks"] == 27156
    assert out["inputs"]["gpu_memory_gib"] == 80.0 and out["inputs"]["tp"] == 1


def test_context_split_as_the_capacity_benchmark():
    assert split_context(2112, 32) == (2048, 32)  # its defaults
    # 32768 - 16 = 32752 tokens; output 32752 // 65 = 503; prompt 32249.
    assert split_context(32768, 16) == (32249, 503)


# -- concurrency -----------------------------------------------------------------------
def _no_preemption(data: dict) -> dict[str, int]:
    """Per config of a capacity run, the benchmark's own headline: the most requests it
    ran at once at the levels where it did not preempt."""
    report = load_script("benchmarks/serving/capacity_report.py")
    names, evicting = report.config_names(data), report.evicting_configs(data)
    return report.headline(data["rows"], names, evicting)["no_preemption_concurrency"]


def test_prediction_equals_the_cpu_measurement():
    """Per config and per concurrency level, the peak running requests of the committed
    capacity run (levels without preemption) equal the planner's burst of that many."""
    data = json.loads(MEASURED.read_text())
    d, s = data["derived"], data["settings"]
    usable = d["pool_blocks"] - 1
    assert usable == 132
    checked = set()
    for row in data["rows"]:
        if row["preemptions"] or row["failed"]:
            continue
        name = row["config"]
        cfg = None
        if name != "stock":
            method, _, knob_text = name.partition(":")
            knobs = dict(kv.split("=") for kv in knob_text.split(",") if kv)
            knobs = {k: int(v) if v.isdigit() else v for k, v in knobs.items()}
            cfg = EvictionConfig.from_budget(method, d["budget_tokens"],
                                             chunk_size=d["chunk_tokens"],
                                             block_size=d["block_size"], **knobs)
        level = row["concurrency"]
        got = simulate_burst(cfg, usable_blocks=usable, block_size=d["block_size"],
                             prompt_tokens=s["input_len"], output_tokens=s["output_len"],
                             requests=level, max_num_seqs=level, max_num_batched_tokens=2048)
        assert not got.preempted
        assert got.peak_running == row["peak_running"], (name, level)
        checked.add(name)
    assert checked == set(_no_preemption(data))


@pytest.mark.parametrize(("mode", "measured"), [
    (("--prompt-mode", "stream"), 9), (("--prompt-mode", "end"), 5),
    (("--prompt-mode", "end", "--prefill-budget", "832"), 6),
    (("--prompt-mode", "keep"), 2)])
def test_every_prompt_mode_reproduces_the_headline(capsys, mode, measured):
    data = json.loads(MEASURED.read_text())
    out = _size(capsys, *CPU_RUN, *mode)
    assert (out["prompt_tokens"], out["output_tokens"]) == (2048, 32)
    assert out["stock"]["concurrent"] == _no_preemption(data)["stock"]
    assert out["evicting"]["concurrent"] == measured
    assert out["ratio"] == measured / 2


def test_bounds_by_hand(capsys):
    out = _size(capsys, *CPU_RUN, "--prompt-mode", "stream")
    # budget 416 // 32 = 13 blocks + one 64-token chunk (2 blocks) = 15 while the prompt
    # is computed; 132 // 15 = 8. Decoding, 13 + the one block a 16-token decode interval
    # can add = 14; 132 // 14 = 9.
    assert out["evicting"]["bound_blocks"] == 15 and out["evicting"]["guaranteed"] == 8
    assert out["evicting"]["decode_hard_limit_blocks"] == 14
    assert out["evicting"]["ceiling"] == 9
    # stock: 2080 tokens -> 65 blocks at the end, 64 for the prompt at admission.
    assert out["stock"]["bound_blocks"] == 65 and out["stock"]["admission_blocks"] == 64
    out = _size(capsys, *CPU_RUN, "--prompt-mode", "end")
    # end: the prompt's peak min(64, 64 + 2) = 64 is the bound; 132 // 64 = 2 guaranteed,
    # but past its prompt a request reserves only 13 + 1 = 14: 132 // 14 = 9.
    assert out["evicting"]["bound_blocks"] == 64 and out["evicting"]["guaranteed"] == 2
    assert out["evicting"]["decode_hard_limit_blocks"] == 14
    assert out["evicting"]["ceiling"] == 9
    out = _size(capsys, *CPU_RUN, "--prompt-mode", "end", "--max-num-seqs", "8")
    assert out["evicting"]["ceiling"] == 8  # capped by --max-num-seqs


def test_ratio_and_token_budgets_agree(capsys):
    # 0.2 of 2080 tokens -> ceil(0.2 x 65 blocks) = 13 blocks, the same as 416 tokens.
    by_ratio = _size(capsys, *STREAM_RUN, "--budget", "0.2")
    by_tokens = _size(capsys, *STREAM_RUN)
    assert by_ratio["eviction"]["keep_ratio"] == 0.2 and by_ratio["eviction"]["max_tokens"] is None
    assert by_tokens["eviction"]["max_tokens"] == 416
    assert by_ratio["evicting"] == by_tokens["evicting"]
    # 0.5: the prompt's peak ceil(0.5 x 64) = 32 blocks + 2 = 34; decoding, 0.5 of the
    # 65 blocks at the end, 33 + 1 = 34 too. 132 // 34 = 3.
    half = _size(capsys, *STREAM_RUN, "--budget", "0.5")
    assert half["evicting"]["bound_blocks"] == 34 and half["evicting"]["concurrent"] == 3


def test_stock_preempting_falls_back_to_whole_sequences(capsys):
    # 2048 + 160 tokens: 64 prompt blocks at admission (two fit in 132), 69 at the end:
    # two need 138 > 132, so the burst preempts; whole sequences: 132 // 69 = 1.
    out = _size(capsys, *CPU_RUN, "--prompt-tokens", "2048", "--output-tokens", "160",
                "--context", "2240")
    assert out["stock"]["peak_running"] == 2 and out["stock"]["preempts"]
    assert out["stock"]["concurrent"] == 1


def test_max_num_seqs_caps(capsys):
    out = _size(capsys, *STREAM_RUN, "--max-num-seqs", "5")
    assert out["evicting"]["concurrent"] == 5
    assert any("--max-num-seqs 5" in n for n in out["notes"])


def test_text_output_names_the_numbers(capsys):
    assert main(list(CPU_RUN)) == 0
    text = capsys.readouterr().out
    assert "KV blocks per GPU: 133 (132 usable" in text
    assert "with eviction:                 5" in text and "ratio:" in text  # end, the default


# -- bad input -------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "named"), [
    (("--budget", "lots"), "--budget"),
    (("--budget", "1.5"), "--budget"),
    (("--budget", "0"), "--budget"),
    (("--tp", "3"), "--tp"),
    (("--tp", "0"), "--tp"),
    (("--gpu-util", "1.5"), "--gpu-util"),
    (("--model", "no-such-model"), "--model"),
    (("--prompt-tokens", "100"), "--prompt-tokens"),
    (("--prompt-tokens", "2100", "--output-tokens", "100"), "--context"),
    (("--prompt-mode", "stream", "--prefill-budget", "832"), "--prefill-budget"),
    (("--prompt-mode", "sometimes"), "--prompt-mode"),
    (("--method", "none"), "--method"),
    (("--chunk-size", "-1"), "--chunk-size"),
])
def test_bad_flags_exit_2_naming_the_flag(capsys, flags, named):
    with pytest.raises(SystemExit) as exc:
        main([*CPU_RUN, *flags])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--gpu-util", "1.5", "must be a number in (0, 1], got '1.5'"),
    ("--gpu-util", "nan", "must be a number in (0, 1], got 'nan'"),
    ("--gpu-memory-gib", "0", "must be a number > 0, got '0'"),
    ("--gpu-memory-gib", "lots", "must be a number > 0, got 'lots'"),
    ("--overhead-gib", "-1", "must be a number >= 0, got '-1'"),
    ("--overhead-gib", "inf", "must be a number >= 0, got 'inf'"),
])
def test_number_flags_refused_as_the_server_refuses_them(capsys, flag, value, says):
    """The float flags share the server's parser (argtypes.float_in, as --kv-keep-ratio)."""
    with pytest.raises(SystemExit) as exc:
        main(["--model", "llama-3.1-8b", "--gpu-memory-gib", "80", "--context", "4096",
              "--budget", "0.2", flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}: {says}" in capsys.readouterr().err


def test_no_overhead_is_allowed(capsys):
    out = _size(capsys, "--model", "llama-3.1-8b", "--gpu-memory-gib", "80", "--context",
                "4096", "--budget", "0.2", "--overhead-gib", "0")
    assert out["memory"]["overhead_bytes"] == 0


def test_memory_or_pool_is_required(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model", "llama-3.1-8b", "--context", "4096", "--budget", "0.2"])
    assert exc.value.code == 2 and "--gpu-memory-gib" in capsys.readouterr().err


def test_cli_dispatches_size(capsys):
    from nexus_vllm.cli import main as cli_main

    assert cli_main(["size", *CPU_RUN, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evicting"]["concurrent"] == 5


def test_old_command_name_still_sizes_and_says_so(capsys):
    from nexus_vllm.cli import main as cli_main

    assert cli_main(["plan", *CPU_RUN, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["evicting"]["concurrent"] == 5
    assert "`plan` is now `size`" in captured.err


# -- hybrid sliding-window models --------------------------------------------------------
# A small Gemma-3-shaped model: 6 layers, every third full attention, window 64.
SMALL_GEMMA3 = {"model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256,
                "intermediate_size": 512, "vocab_size": 1000, "torch_dtype": "bfloat16",
                "sliding_window": 64,
                "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}
# 512 + 64 tokens, budget 128 tokens (8 blocks), 64-token chunks, 128-token steps, two in
# flight (async scheduling), 16-token blocks.
HYBRID_RUN = ("--pool-blocks", "200", "--context", "1024", "--prompt-tokens", "512",
              "--output-tokens", "64", "--budget", "128", "--chunk-size", "64",
              "--prompt-mode", "stream", "--max-num-batched-tokens", "128",
              "--steps-in-flight", "2", "--max-num-seqs", "64")


def _write_config(tmp_path, config: dict, total_size: int | None = None) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if total_size is not None:
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total_size}}))
    return str(tmp_path)


def test_sliding_layers_from_the_config(tmp_path):
    m = model_shape(_write_config(tmp_path, SMALL_GEMMA3))
    assert m.sliding_window == 64 and m.sliding_layers == (0, 1, 3, 4)
    assert m.full_layers == (2, 5)
    # Gemma 3's text_config often omits what equals transformers' defaults (Gemma3TextConfig:
    # 8 heads, 4 KV heads, head_dim 256, every 6th layer full); the dtype sits at the top.
    mm = {"model_type": "gemma3", "torch_dtype": "bfloat16",
          "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                          "intermediate_size": 10240, "num_hidden_layers": 34,
                          "sliding_window": 1024}}
    m = model_shape(_write_config(tmp_path, mm))
    assert (m.layers, m.attention_heads, m.kv_heads, m.head_size, m.dtype) == (
        34, 8, 4, 256, "bfloat16")
    assert m.sliding_window == 1024 and m.full_layers == (5, 11, 17, 23, 29)
    # Qwen2: a window only with use_sliding_window, from max_window_layers on.
    qwen = {**BUILTIN_CONFIGS["qwen2.5-72b"], "num_hidden_layers": 4, "sliding_window": 4096,
            "use_sliding_window": False, "max_window_layers": 2}
    assert model_shape(_write_config(tmp_path, qwen)).sliding_layers == ()
    m = model_shape(_write_config(tmp_path, {**qwen, "use_sliding_window": True}))
    assert m.sliding_layers == (2, 3) and m.full_layers == (0, 1)
    # Gemma 2 and gpt-oss without layer_types: every other layer slides, from the first.
    gemma2 = {**SMALL_GEMMA3, "model_type": "gemma2"}
    del gemma2["layer_types"]
    assert model_shape(_write_config(tmp_path, gemma2)).full_layers == (1, 3, 5)


@pytest.mark.parametrize(("change", "says"), [
    ({"layer_types": ["sliding_attention", "full_attention"]}, "lists 2 layers"),
    ({"layer_types": ["chunked_attention"] * 6}, "only full_attention and sliding_attention"),
])
def test_bad_layer_types_are_refused(tmp_path, capsys, change, says):
    path = _write_config(tmp_path, {**SMALL_GEMMA3, **change})
    with pytest.raises(SystemExit) as exc:
        main(["--model", path, *HYBRID_RUN])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--model" in err and says in err


def test_builtin_gemma3_shapes():
    small, large = BUILTIN_MODELS["gemma-3-270m"], BUILTIN_MODELS["gemma-3-27b"]
    assert (small.layers, small.attention_heads, small.kv_heads, small.head_size) == (
        18, 4, 1, 256)
    assert small.sliding_window == 512 and small.full_layers == (5, 11, 17)
    # 268_098_176: the published count of gemma-3-270m (tied embeddings, four norms and
    # the Q/K norms per layer).
    assert param_count(BUILTIN_CONFIGS["gemma-3-270m"]) == 268_098_176
    assert (large.layers, large.attention_heads, large.kv_heads, large.head_size) == (
        62, 32, 16, 128)
    assert large.sliding_window == 1024 and len(large.full_layers) == 10
    # 10 full layers, 52 sliding: groups of 10, the sliding ones in 6 groups of 9 or 8.
    sizes = [(len(g.layers), g.window) for g in kv_cache_groups(large)]
    assert sizes == [(9, 1024)] * 4 + [(8, 1024)] * 2 + [(10, None)]


def test_groups_by_hand(tmp_path):
    m = model_shape(_write_config(tmp_path, SMALL_GEMMA3))
    # 2 full and 4 sliding layers: groups of min(2, 4) = 2 layers (4 is not under 1.5 x 2),
    # the sliding ones taking every other sliding layer; the kinds in order of first layer.
    assert kv_cache_groups(m) == [KVGroup((0, 3), 64), KVGroup((1, 4), 64),
                                  KVGroup((2, 5), None)]
    # A block spans one group's 2 layers: 2 x 2 layers x 2 KV heads x 64 x 2 B x 16 tokens.
    assert block_bytes_per_gpu(m, tp=1, pp=1, block_size=16) == 16384
    # pp=2 (layers 0-2, 3-5): each group has one layer on each stage.
    assert block_bytes_per_gpu(m, tp=1, pp=2, block_size=16) == 8192
    # 1 GiB - 256 MiB of weights = 768 MiB for KV; / 16384 B = 49152 blocks.
    m = model_shape(_write_config(tmp_path, SMALL_GEMMA3, total_size=2**28))
    got = kv_pool_blocks(m, gpu_memory_gib=1, gpu_util=1, overhead_gib=0, tp=1, pp=1,
                         block_size=16)
    assert got["pool_blocks"] == 49152 and got["layers_per_block"] == 2
    # 13 full, 12 sliding (gpt-oss-20b with a drafter): 13 < 1.5 x 12, so groups of 13.
    oss = {**SMALL_GEMMA3, "num_hidden_layers": 25,
           "layer_types": ["full_attention"] * 13 + ["sliding_attention"] * 12}
    groups = kv_cache_groups(model_shape(_write_config(tmp_path, oss)))
    assert [len(g.layers) for g in groups] == [13, 12]


def test_pp_stages_as_vllm_splits_them():
    # 32 // 3 = 10 each, the remainder 2 to the stages before the last.
    assert [len(s) for s in pp_stages(32, 3)] == [11, 11, 10]
    assert [len(s) for s in pp_stages(6, 4)] == [1, 2, 2, 1]


def test_hybrid_blocks_per_request_by_hand(tmp_path, capsys):
    out = _size(capsys, "--model", _write_config(tmp_path, SMALL_GEMMA3), *HYBRID_RUN)
    sliding = [g for g in out["kv_cache_groups"] if g["kind"] == "sliding_window"]
    (full,) = [g for g in out["kv_cache_groups"] if g["kind"] == "full_attention"]
    assert [g["layers"] for g in sliding] == [[0, 3], [1, 4]] and full["layers"] == [2, 5]
    assert full["evicted"] and not any(g["evicted"] for g in sliding)
    # 512 + 64 = 576 tokens: 36 blocks, 32 for the prompt. Full group, stream, budget 8
    # blocks: 8 + one 64-token chunk (4 blocks) = 12 while the prompt is computed, 8 + one
    # 16-token decode interval (1 block) = 9 decoding.
    assert (full["stock_admission_blocks"], full["stock_blocks"]) == (32, 36)
    assert (full["evicting_bound_blocks"], full["evicting_decode_hard_limit_blocks"]) == (12, 9)
    # Each sliding group while the prompt is computed: the window less one plus the two
    # steps in flight, on block boundaries, plus the block the window starts in. Stock,
    # 128-token steps: ceil((64 - 1 + 256) / 16) + 1 = 21 (what stock admission caps the
    # prompt's 32 blocks at). With eviction in stream mode each request's prompt step is
    # capped at its 64-token chunk: ceil((63 + 128) / 16) + 1 = 13 (the rule before: 21).
    # Decoding, one token a step: the window plus 2 tokens in flight,
    # ceil((63 + 2) / 16) + 1 = 6.
    for g in sliding:
        assert (g["stock_blocks"], g["evicting_bound_blocks"],
                g["evicting_decode_hard_limit_blocks"]) == (21, 13, 6)
        assert g["stock_admission_blocks"] == 21
        assert (g["evicting_prompt_step_tokens"], g["evicting_in_flight_tokens"]) == (64, 128)
    # Per request over the groups: stock admits on 32 + 2 x 21 = 74 free blocks and holds
    # at most 36 + 2 x 21 = 78; eviction reserves 12 + 26 = 38, then 9 + 12 = 21.
    assert (out["stock"]["admission_blocks"], out["stock"]["bound_blocks"]) == (74, 78)
    assert (out["evicting"]["bound_blocks"], out["evicting"]["decode_hard_limit_blocks"]) == (
        38, 21)
    # 199 usable blocks: 199 // 38 = 5 guaranteed, 199 // 21 = 9 at the ceiling; the burst,
    # admitted step by step as the plugin's gate admits (a burst through the gate itself:
    # tests/integration/test_manager.py), runs 8 (7 under the rule before). Stock:
    # 199 // 78 = 2 whole, and the burst runs 3 (a third finds 199 - 2 x 46 >= 74 free).
    assert (out["evicting"]["guaranteed"], out["evicting"]["ceiling"]) == (5, 9)
    assert out["evicting"]["concurrent"] == 8
    assert (out["stock"]["guaranteed"], out["stock"]["concurrent"]) == (2, 3)
    assert not out["stock"]["preempts"]


def test_hybrid_text_names_the_groups(tmp_path, capsys):
    assert main(["--model", _write_config(tmp_path, SMALL_GEMMA3), *HYBRID_RUN]) == 0
    text = capsys.readouterr().out
    assert "KV cache groups (vLLM's hybrid KV cache manager): 3" in text
    assert "1 full attention (2 layers, evicted)" in text
    assert "2 sliding window 64 tokens (2, 2 layers, left to vLLM)" in text
    assert "each sliding group: stock 21 while the prompt is computed" in text
    assert "admission reserves 21; with eviction 13 while the prompt is computed (its " \
        "window plus 2 steps of 64, the chunk each request's prompt step is capped at)" in text
    assert "6 reserved once decoding (its window plus 2 decode tokens)" in text


def test_hybrid_without_a_step_budget_takes_vllms(tmp_path, capsys):
    flags = [f for f in HYBRID_RUN]
    i = flags.index("--max-num-batched-tokens")
    del flags[i:i + 2]
    out = _size(capsys, "--model", _write_config(tmp_path, SMALL_GEMMA3), *flags)
    # ceil((63 + 8192) / 16) + 1 = 517 > the sequence's 36 blocks: the whole sequence.
    assert all(g["stock_blocks"] == 36 for g in out["kv_cache_groups"]
               if g["kind"] == "sliding_window")
    assert any("--max-num-batched-tokens 8192" in n for n in out["notes"])


def test_hybrid_startup_check_counts_every_group(tmp_path, capsys):
    # One --max-model-len 1024 request: 64 full blocks + 2 x 21 = 106 > 99 usable.
    flags = [*HYBRID_RUN]
    flags[flags.index("--pool-blocks") + 1] = "100"
    out = _size(capsys, "--model", _write_config(tmp_path, SMALL_GEMMA3), *flags)
    assert any("needs 106 blocks, the pool has 99" in n for n in out["notes"])


def test_window_allowance_follows_the_phase_and_the_steps_in_flight():
    # Window 64, 16-token blocks, 128-token steps, 512 + 64 tokens.
    def allowance(k, tokens=0, prefill_end=None, total=576, windows=(64,)):
        return window_allowance(total, 16, list(windows), 128, k, tokens=tokens,
                                prefill_end=prefill_end)
    # One step in flight: ceil((63 + 128) / 16) + 1 = 13 until one decode step follows the
    # prompt, then ceil((63 + 1) / 16) + 1 = 5 (the rule before: 13 throughout).
    assert allowance(1) == allowance(1, 300, 512) == allowance(1, 512, 512) == 13
    assert allowance(1, 513, 512) == allowance(1, 576, 512) == 5
    # Async scheduling, two steps in flight: ceil((63 + 256) / 16) + 1 = 21 until two
    # decode steps follow it (the last prompt step may be in flight at the first), then
    # ceil((63 + 2) / 16) + 1 = 6.
    assert allowance(2) == allowance(2, 513, 512) == 21
    assert allowance(2, 514, 512) == 6
    # A resumed request recomputing 540 tokens decodes from there; groups add up.
    assert allowance(2, 530, 540) == 21 and allowance(2, 542, 540) == 6
    assert allowance(2, 514, 512, windows=(64, 64, 128)) == 6 + 6 + 10
    # Never more than the sequence's blocks: 40 tokens hold 3 in every phase.
    assert allowance(2, total=40) == allowance(2, 40, 30, total=40) == 3


def test_window_allowance_counts_chunks_where_the_server_caps_prompt_steps():
    # Window 64, 16-token blocks, 128-token steps, two in flight, 512 + 64 tokens. Where
    # the server's config evicts mid-prompt (stream, or end under a prefill budget) the
    # plugin caps each request's prompt step at its 48-token chunk: two chunks in flight,
    # ceil((63 + 96) / 16) + 1 = 11 (the rule before: two whole steps, 21). Decoding: 6.
    def allowance(cfg, tokens=0, prefill_end=None):
        return window_allowance(576, 16, [64], 128, 2, tokens=tokens,
                                prefill_end=prefill_end, cfg=cfg)
    stream = EvictionConfig(max_tokens=128, block_size=16, chunk_size=48, prompt_mode="stream")
    assert allowance(stream) == allowance(stream, 513, 512) == 11
    assert allowance(stream, 514, 512) == 6
    assert allowance(stream.replace(prompt_mode="end", prefill_budget=256)) == 11
    # No cap (end, keep; stock): whole steps; a chunk above the step: the step.
    for cfg in (stream.replace(prompt_mode="end"), stream.replace(prompt_mode="keep"),
                stream.replace(chunk_size=512), None):
        assert allowance(cfg) == 21, cfg


def test_the_sizer_reserves_the_window_groups_as_admission():
    pytest.importorskip("vllm")
    from nexus_vllm.integration.compat.vllm_compat import WindowGroup
    from nexus_vllm.integration.scheduler.live_blocks import WindowBlocks

    groups = [WindowGroup(0, None, 64, 16), WindowGroup(2, None, 64, 16),
              WindowGroup(3, None, 1024, 16)]
    stream = EvictionConfig(max_tokens=128, block_size=16, chunk_size=48, prompt_mode="stream")
    for k, cfg in itertools.product((1, 2, 3), (None, stream, stream.replace(
            prompt_mode="end"))):
        blocks = WindowBlocks(groups, 128, k, server_cfg=cfg)
        for total, prefill_end in ((40, 30), (576, 512), (4096, 3000)):
            assert blocks.allowance(total) == window_allowance(
                total, 16, [64, 64, 1024], 128, k, cfg=cfg), (k, total)
            for tokens in range(prefill_end - 130, total + 1, 7):
                assert blocks.allowance(total, tokens, prefill_end) == window_allowance(
                    total, 16, [64, 64, 1024], 128, k, tokens=tokens,
                    prefill_end=prefill_end, cfg=cfg), (k, total, tokens)


def test_stock_sliding_group_frees_what_leaves_the_window():
    # One request, one sliding group of window 64, 512 + 64 tokens in 128-token steps.
    # Admission needs 32 prompt blocks + min(32, ceil((63 + 128) / 16) + 1 = 13) = 45 free.
    # The most it holds is at its last prompt step (384 computed, 512 allocated): 32 full
    # blocks + 32 - (384 - 63) // 16 = 12 in the window = 44. Held whole, the window group
    # would reach 36 + 36 = 72 blocks and preempt.
    args = {"block_size": 16, "prompt_tokens": 512, "output_tokens": 64, "requests": 1,
            "max_num_seqs": 1, "max_num_batched_tokens": 128, "windows": [64],
            "in_flight_tokens": 128, "max_model_len": 1024}
    got = simulate_burst(None, usable_blocks=45, **args)
    assert got.peak_running == 1 and not got.preempted
    assert simulate_burst(None, usable_blocks=44, **args).peak_running == 0
    assert window_held_blocks(64, 16, 384, 512) == 12


def _plugin_refusal(trait: str) -> str:
    from nexus_vllm.integration.compat.attention_traits import (
        AttentionTraits,
        unsupported_attention,
    )

    (reason,) = unsupported_attention(AttentionTraits(**{trait: True}))
    return reason


@pytest.mark.parametrize("config", [
    # Mistral-style: a window and no layer_types, so every layer slides.
    {**BUILTIN_CONFIGS["llama-3.1-8b"], "model_type": "mistral", "sliding_window": 4096},
    {**SMALL_GEMMA3, "layer_types": ["sliding_attention"] * 6},
], ids=["mistral", "layer_types"])
def test_all_sliding_models_are_refused_as_the_server_refuses_them(tmp_path, capsys, config):
    with pytest.raises(SystemExit) as exc:
        main(["--model", _write_config(tmp_path, config), *HYBRID_RUN])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--model" in err and "--kv-eviction none" in err
    assert _plugin_refusal("sliding_window_only") in err  # the server's own words


def test_more_than_one_full_attention_group_is_refused(tmp_path, capsys):
    # 6 full and 2 sliding layers: groups of 2, so 3 full-attention groups.
    config = {**SMALL_GEMMA3, "num_hidden_layers": 8,
              "layer_types": ["full_attention"] * 6 + ["sliding_attention"] * 2}
    m = model_shape(_write_config(tmp_path, config))
    assert "in 3 KV cache groups" in (eviction_refusal(m) or "")
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(tmp_path), *HYBRID_RUN])
    assert exc.value.code == 2 and "exactly one full-attention group" in \
        capsys.readouterr().err


def test_sizing_imports_no_vllm():
    code = "import sys, nexus_vllm.sizing; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# -- multi-head latent attention (DeepSeek-V2/V3) ------------------------------------------
@pytest.mark.parametrize(("name", "params", "layers", "heads"), [
    ("deepseek-v2-lite", 15_706_484_224, 27, 16), ("deepseek-v3", 671_026_419_200, 61, 128)])
def test_mla_builtins_count_the_published_parameters(name, params, layers, heads):
    # 15.7e9 (DeepSeek-V2-Lite) and 671e9 (DeepSeek-V3, without its MTP layer).
    assert mla_param_count(BUILTIN_CONFIGS[name]) == params
    m = BUILTIN_MODELS[name]
    # One latent row per token per layer: kv_lora_rank 512 + qk_rope_head_dim 64.
    assert (m.mla, m.layers, m.attention_heads, m.kv_heads, m.head_size) == (
        True, layers, heads, 1, 576)
    assert m.sliding_window is None and len(kv_cache_groups(m)) == 1


def test_mla_weights_bf16_and_fp8():
    assert BUILTIN_MODELS["deepseek-v2-lite"].weight_bytes == 2 * 15_706_484_224
    # DeepSeek-V3's checkpoint: its layers' linear weights in fp8 with a float32 scale per
    # 128 x 128 block, embeddings, LM head, norms and router in bf16: 673 GB (its published
    # checkpoint, 689 GB, also holds the MTP layer vLLM does not load without a drafter).
    v3 = BUILTIN_MODELS["deepseek-v3"]
    assert 670e9 < v3.weight_bytes < 676e9 and "fp8" in v3.weight_source


def test_mla_page_is_the_latent_row_on_every_tp_rank():
    # K only (no V), not split by TP: 576 x 2 B x 16 tokens per layer on every rank.
    m = BUILTIN_MODELS["deepseek-v3"]
    for tp in (1, 2, 8):
        assert page_bytes_per_layer(m, tp=tp, block_size=16) == 576 * 2 * 16
        assert block_bytes_per_gpu(m, tp=tp, pp=1, block_size=16) == 61 * 576 * 2 * 16
    # pp=2: layers 0-30 and 31-60, the larger stage sets the block.
    assert block_bytes_per_gpu(m, tp=8, pp=2, block_size=16) == 31 * 576 * 2 * 16


def test_mla_config_json_and_sparse_mla(tmp_path):
    m = model_shape(_write_config(tmp_path, BUILTIN_CONFIGS["deepseek-v2-lite"]))
    assert (m.mla, m.kv_heads, m.head_size) == (True, 1, 576)
    sparse = {**BUILTIN_CONFIGS["deepseek-v3"], "index_topk": 2048}
    with pytest.raises(ConfigError, match="sparse MLA"):
        model_shape(_write_config(tmp_path, sparse))


def test_mla_sizing_by_hand(capsys):
    # 141 GiB x 0.9 - 673.15 GB / 8 - 4 GiB = 44.53 GiB for KV, / (61 x 576 x 2 B x 16)
    # = 42530 blocks on every GPU of the tp=8 replica (the latent row is not split).
    out = _size(capsys, "--model", "deepseek-v3", "--gpu-memory-gib", "141", "--tp", "8",
                "--context", "32768", "--budget", "0.2")
    assert out["pool_blocks"] == 42530
    assert out["memory"]["block_bytes_per_gpu"] == 1_124_352
    assert any("turns chunked prefill (and prefix caching) off for MLA" in n
               for n in out["notes"])
    text = _text(capsys, "--model", "deepseek-v3", "--gpu-memory-gib", "141", "--tp", "8",
                 "--context", "32768", "--budget", "0.2", "--prompt-mode", "stream")
    assert "MLA, one latent row of 576 per token per layer (K only)" in text
    assert "61 layers x 576 (the latent row, whole on every TP rank) x 2 B x 16 tokens" in text
    assert "refuses prompt_mode stream" in text and "refused on CPU" in text


def _text(capsys, *flags: str) -> str:
    assert main(list(flags)) == 0
    return capsys.readouterr().out


# -- against vLLM's own functions (skipped without vLLM) ---------------------------------
@pytest.fixture(scope="module")
def vllm_kv():
    pytest.importorskip("vllm")
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    def specs(model, block_size):
        kw = {"block_size": block_size, "num_kv_heads": model.kv_heads,
              "head_size": model.head_size, "dtype": torch.bfloat16}
        if model.mla:  # as MLAAttention.get_kv_cache_spec builds it on every TP rank
            return {f"model.layers.{i}.self_attn.attn": MLAAttentionSpec(
                        max_tp_shards=1, cache_dtype_str="auto", **kw)
                    for i in range(model.layers)}
        return {f"model.layers.{i}.self_attn.attn":
                SlidingWindowSpec(sliding_window=model.sliding_window, **kw)
                if i in model.sliding_layers else FullAttentionSpec(**kw)
                for i in range(model.layers)}

    config = VllmConfig()
    config.cache_config.kv_cache_layout = "LBHNC"
    return {"config": config, "utils": kv_cache_utils, "specs": specs,
            "BlockPool": BlockPool, "SlidingWindowManager": SlidingWindowManager}


def _layer_index(name: str) -> int:
    return int(name.split(".")[2])


@pytest.mark.parametrize("name", ["small", "gemma-3-270m", "gemma-3-27b", "deepseek-v2-lite",
                                  "deepseek-v3"])
def test_groups_and_pool_match_vllm(tmp_path, vllm_kv, name):
    m = (model_shape(_write_config(tmp_path, SMALL_GEMMA3)) if name == "small"
         else BUILTIN_MODELS[name])
    utils, config = vllm_kv["utils"], vllm_kv["config"]
    specs = vllm_kv["specs"](m, 16)
    groups = utils.get_kv_cache_groups(config, dict(specs))
    assert [tuple(_layer_index(n) for n in g.layer_names) for g in groups] == [
        g.layers for g in kv_cache_groups(m)]
    memory = 10**9
    for pp in (1, 2, 3):
        # Each stage's worker holds its layers of every group; the pool is the smallest.
        workers = [{n: s for n, s in specs.items() if _layer_index(n) in stage}
                   for stage in pp_stages(m.layers, pp)]
        blocks = min(utils.get_kv_cache_config_from_groups(
            config, utils._project_kv_cache_groups_to_worker(groups, worker), memory
        ).num_blocks for worker in workers)
        assert blocks == memory // block_bytes_per_gpu(m, tp=1, pp=pp, block_size=16), pp


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3"])
def test_mla_page_size_matches_vllms_spec(vllm_kv, name):
    """vLLM's ``MLAAttentionSpec`` as ``MLAAttention.get_kv_cache_spec`` builds it (one
    KV head, ``max_tp_shards=1``, head size kv_lora_rank + qk_rope_head_dim, no V), the
    same on every TP rank: its ``page_size_bytes`` is the sizer's page for any TP."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    m = BUILTIN_MODELS[name]
    for bs in (16, 64):
        spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, max_tp_shards=1,
                                head_size=m.head_size, dtype=torch.bfloat16,
                                cache_dtype_str="auto")
        for tp in (1, 2, 8):
            assert page_bytes_per_layer(m, tp=tp, block_size=bs) == spec.page_size_bytes \
                == 576 * 2 * bs, (bs, tp)


def test_window_blocks_match_vllms_sliding_window_manager(vllm_kv):
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    bs, window, step = 16, 64, 48
    spec = SlidingWindowSpec(block_size=bs, num_kv_heads=2, head_size=64,
                             dtype=torch.bfloat16, sliding_window=window)
    cap = spec.max_admission_blocks_per_request(max_in_flight_tokens=2 * step,
                                                max_model_len=4096)
    assert cap == window_max_blocks(window, bs, 2 * step, 4096)
    # While the prompt is computed, the plugin reserves vLLM's own cap (two steps in flight).
    assert window_allowance(4096, bs, [window], step, 2) == cap
    manager = vllm_kv["SlidingWindowManager"](
        spec, block_pool=vllm_kv["BlockPool"](1000, False, bs), enable_caching=False,
        kv_cache_group_id=0, scheduler_block_size=bs, max_admission_blocks_per_request=cap)
    # Stock admission of a 300-token prompt: its 19 blocks capped at the window + in flight.
    assert manager.get_num_blocks_to_allocate(
        "r", 300, [], 0, 0, 300, apply_admission_cap=True) == stock_admission_blocks(
        300, bs, full_groups=0, windows=[window], in_flight_tokens=2 * step,
        max_model_len=4096)
    done, most = 0, 0
    for n in [step] * 6 + [1] * 40:  # a prompt in steps, then decode
        manager.remove_skipped_blocks("r", done)
        manager.allocate_new_blocks("r", done + n, done + n)
        held = sum(not b.is_null for b in manager.req_to_blocks["r"])
        assert held == window_held_blocks(window, bs, done, done + n), done
        most = max(most, held)
        done += n
    assert most <= window_allowance(done, bs, [window], step)
