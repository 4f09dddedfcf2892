"""``nexus-vllm plan``: the arithmetic by hand, and the prediction against the CPU measurement."""

import importlib.util
import json
import pathlib

import pytest

from nexus_vllm.core import EvictionConfig
from nexus_vllm.plan import (
    BUILTIN_CONFIGS,
    BUILTIN_MODELS,
    block_bytes_per_gpu,
    kv_pool_blocks,
    main,
    model_shape,
    param_count,
    simulate_burst,
    split_context,
)

REPO = pathlib.Path(__file__).resolve().parents[1]
MEASURED = REPO / "docs" / "figures" / "serving_modes" / "capacity.json"
LLAMA_8B = BUILTIN_MODELS["llama-3.1-8b"]


def _plan(capsys, *flags: str) -> dict:
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
    out = _plan(capsys, "--model", "llama-3.1-8b", "--gpu-memory-gib", "80", "--context",
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
    spec = importlib.util.spec_from_file_location(
        "capacity_report", REPO / "benchmarks" / "serving" / "capacity_report.py")
    assert spec is not None and spec.loader is not None
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
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
    out = _plan(capsys, *CPU_RUN, *mode)
    assert (out["prompt_tokens"], out["output_tokens"]) == (2048, 32)
    assert out["stock"]["concurrent"] == _no_preemption(data)["stock"]
    assert out["evicting"]["concurrent"] == measured
    assert out["ratio"] == measured / 2


def test_bounds_by_hand(capsys):
    out = _plan(capsys, *CPU_RUN, "--prompt-mode", "stream")
    # budget 416 // 32 = 13 blocks + one 64-token chunk (2 blocks) = 15 while the prompt
    # is computed; 132 // 15 = 8. Decoding, 13 + the one block a 16-token decode interval
    # can add = 14; 132 // 14 = 9.
    assert out["evicting"]["bound_blocks"] == 15 and out["evicting"]["guaranteed"] == 8
    assert out["evicting"]["decode_hard_limit_blocks"] == 14
    assert out["evicting"]["ceiling"] == 9
    # stock: 2080 tokens -> 65 blocks at the end, 64 for the prompt at admission.
    assert out["stock"]["bound_blocks"] == 65 and out["stock"]["admission_blocks"] == 64
    out = _plan(capsys, *CPU_RUN, "--prompt-mode", "end")
    # end: the prompt's peak min(64, 64 + 2) = 64 is the bound; 132 // 64 = 2 guaranteed,
    # but past its prompt a request reserves only 13 + 1 = 14: 132 // 14 = 9.
    assert out["evicting"]["bound_blocks"] == 64 and out["evicting"]["guaranteed"] == 2
    assert out["evicting"]["decode_hard_limit_blocks"] == 14
    assert out["evicting"]["ceiling"] == 9
    out = _plan(capsys, *CPU_RUN, "--prompt-mode", "end", "--max-num-seqs", "8")
    assert out["evicting"]["ceiling"] == 8  # capped by --max-num-seqs


def test_ratio_and_token_budgets_agree(capsys):
    # 0.2 of 2080 tokens -> ceil(0.2 x 65 blocks) = 13 blocks, the same as 416 tokens.
    by_ratio = _plan(capsys, *STREAM_RUN, "--budget", "0.2")
    by_tokens = _plan(capsys, *STREAM_RUN)
    assert by_ratio["eviction"]["keep_ratio"] == 0.2 and by_ratio["eviction"]["max_tokens"] is None
    assert by_tokens["eviction"]["max_tokens"] == 416
    assert by_ratio["evicting"] == by_tokens["evicting"]
    # 0.5: the prompt's peak ceil(0.5 x 64) = 32 blocks + 2 = 34; decoding, 0.5 of the
    # 65 blocks at the end, 33 + 1 = 34 too. 132 // 34 = 3.
    half = _plan(capsys, *STREAM_RUN, "--budget", "0.5")
    assert half["evicting"]["bound_blocks"] == 34 and half["evicting"]["concurrent"] == 3


def test_stock_preempting_falls_back_to_whole_sequences(capsys):
    # 2048 + 160 tokens: 64 prompt blocks at admission (two fit in 132), 69 at the end:
    # two need 138 > 132, so the burst preempts; whole sequences: 132 // 69 = 1.
    out = _plan(capsys, *CPU_RUN, "--prompt-tokens", "2048", "--output-tokens", "160",
                "--context", "2240")
    assert out["stock"]["peak_running"] == 2 and out["stock"]["preempts"]
    assert out["stock"]["concurrent"] == 1


def test_max_num_seqs_caps(capsys):
    out = _plan(capsys, *STREAM_RUN, "--max-num-seqs", "5")
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
    out = _plan(capsys, "--model", "llama-3.1-8b", "--gpu-memory-gib", "80", "--context",
                "4096", "--budget", "0.2", "--overhead-gib", "0")
    assert out["memory"]["overhead_bytes"] == 0


def test_memory_or_pool_is_required(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model", "llama-3.1-8b", "--context", "4096", "--budget", "0.2"])
    assert exc.value.code == 2 and "--gpu-memory-gib" in capsys.readouterr().err


def test_cli_dispatches_plan(capsys):
    from nexus_vllm.cli import main as cli_main

    assert cli_main(["plan", *CPU_RUN, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evicting"]["concurrent"] == 5
