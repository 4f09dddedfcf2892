"""Config layering, CLI flags and per-request validation (no server; a few seconds)."""

from __future__ import annotations

import json
import pathlib

import pytest

from nexus_vllm.core.budget import budget_blocks
from nexus_vllm.integration.config import config_from_additional, request_config
from nexus_vllm.integration.frontend.request_args import validate_request_args
from nexus_vllm.integration.frontend.server_config import load_config_file, resolve_config
from tests.integration.conftest import HAS_VLLM

# An existing directory: vLLM resolves a hub name even offline; a local path it takes as is.
LOCAL_MODEL = str(pathlib.Path(__file__).parent)


def test_flags_override_additional_and_file(tmp_path) -> None:  # noqa: ANN001
    f = tmp_path / "preset.yaml"
    f.write_text("nexus:\n  method: h2o\n  window: 8\n  keep_ratio: 0.5\n")
    cfg = resolve_config(file=str(f), additional={"window": 12},
                         flags={"max_tokens": 1024, "method": None})
    assert cfg.method == "h2o"
    assert cfg.window == 12
    assert cfg.max_tokens == 1024 and cfg.keep_ratio is None


def test_budget_required_for_evicting_method() -> None:
    with pytest.raises(ValueError, match="--kv-budget"):
        resolve_config(flags={"method": "nexus"})


@pytest.mark.parametrize("flags, flag", [
    ({"method": "nexus", "max_tokens": 64}, "--kv-budget"),  # below sink+recent floor
    ({"method": "nexus", "max_tokens": 1024, "keep_ratio": 0.5}, "--kv-"),
])
def test_bad_flag_values_name_the_flag(flags, flag) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=flag):
        resolve_config(flags=flags)


@pytest.mark.parametrize("file, flags, flag", [
    # The bad key is the flag's own.
    ("prompt_mode: end\n", {"max_tokens": 1024, "prefill_budget": 512},
     "--kv-prefill-budget"),
    # The bad key comes from the file; a flag its cross-field rule reads made it bad.
    ("prompt_mode: end\nprefill_budget: 2048\n", {"max_tokens": 1024, "prompt_mode": "keep"},
     "--kv-prompt-mode"),
    ("prompt_mode: end\nprefill_budget: 512\n", {"max_tokens": 1024}, "--kv-budget"),
    ("max_tokens: 192\n", {"block_size": 64}, "--block-size"),
    # Only the flags of what the failed rule read: the floor rule reads the budget, not the
    # prompt mode (given too, and fine).
    ("prompt_mode: end\nprefill_budget: 512\n", {"max_tokens": 1024, "prompt_mode": "end"},
     "--kv-budget"),
])
def test_the_flag_named_comes_from_the_error_field(tmp_path, file, flags, flag) -> None:  # noqa: ANN001
    f = tmp_path / "preset.yaml"
    f.write_text(f"method: nexus\n{file}")
    with pytest.raises(ValueError, match=f"^{flag}: "):
        resolve_config(file=str(f), flags=flags)


def test_the_error_text_is_not_searched_for_field_names(monkeypatch) -> None:  # noqa: ANN001
    """A message mentioning another given flag's key is still blamed on its own field
    (and on the source when no flag sets it or what its rule reads)."""
    from nexus_vllm.core import EvictionConfig
    from nexus_vllm.core._validate import ConfigError

    def refuse(data):  # noqa: ANN001, ANN202
        raise ConfigError("seed", "seed must be below max_tokens and chunk_size")

    monkeypatch.setattr(EvictionConfig, "from_dict", staticmethod(refuse))
    with pytest.raises(ValueError, match="^--kv-eviction-seed: seed must be below"):
        resolve_config(flags={"max_tokens": 1024, "chunk_size": 64, "seed": 3})
    with pytest.raises(ValueError, match="^flags: seed must be below"):
        resolve_config(flags={"max_tokens": 1024, "chunk_size": 64})


def test_unknown_key_in_file_and_additional(tmp_path) -> None:  # noqa: ANN001
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"method": "nexus", "wnidow": 3}))
    with pytest.raises(ValueError, match="--kv-eviction-config"):
        resolve_config(file=str(f), flags={"max_tokens": 1024})
    with pytest.raises(ValueError, match="--additional-config"):
        resolve_config(additional={"bogus": 1}, flags={"max_tokens": 1024})
    with pytest.raises(ValueError, match="no such file"):
        load_config_file(tmp_path / "missing.yaml")


@pytest.fixture
def throwaway_policy():  # noqa: ANN201
    """A policy registered from this test module (not ``core/policies/``), unregistered
    afterwards so no other test sees it."""
    from dataclasses import dataclass
    from typing import ClassVar

    import torch

    from nexus_vllm.core.policies import POLICIES, EvictionPolicy, register_policy

    @dataclass(frozen=True)
    class OldestFirst(EvictionPolicy):
        """Keeps the oldest blocks: scores each by minus its position."""

        name: ClassVar[str] = "throwaway-oldest"
        evidence: ClassVar[frozenset[str]] = frozenset()

        def score(self, evidence, state):  # noqa: ANN001, ANN201
            return -torch.arange(evidence.num_blocks, dtype=torch.float64)

    register_policy(OldestFirst)
    try:
        yield OldestFirst.name
    finally:
        POLICIES.pop(OldestFirst.name)


def test_a_policy_registered_elsewhere_is_a_method_everywhere(throwaway_policy) -> None:  # noqa: ANN001
    """The method lists follow the registry (they are not frozen when ``core.policies`` is
    imported): a config, the server's ``--kv-eviction`` flag, a request's ``kv_eviction``
    and the evaluation CLI's ``--methods`` all take the new policy, and the eval CLI's
    default run includes it; unregistered, it is refused again."""
    import argparse

    from nexus_vllm.core import METHODS, EvictionConfig
    from nexus_vllm.eval.cli import default_methods, run_config
    from nexus_vllm.integration.frontend.server_config import add_cli_flags

    name = throwaway_policy
    assert name in METHODS and METHODS[-1] == name
    assert EvictionConfig.from_dict({"method": name, "max_tokens": 256}).method == name
    parser = add_cli_flags(argparse.ArgumentParser())
    assert parser.parse_args(["--kv-eviction", name]).kv_eviction == name
    assert name in parser.format_help()
    server = resolve_config(flags={"method": name, "max_tokens": 256})
    assert server.method == name
    validate_request_args({"kv_eviction": name}, resolve_config(
        flags={"method": "nexus", "max_tokens": 256}))
    cfg = run_config({"tasks": "passkey", "methods": f"dense,{name}", "budgets": "0.5"})
    assert cfg.methods == ("dense", name)
    assert default_methods().split(",")[-1] == name
    from nexus_vllm.core.policies import POLICIES

    cls = POLICIES.pop(name)
    try:
        assert name not in METHODS and name not in default_methods().split(",")
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-eviction", name])
        with pytest.raises(ValueError, match="method must be one of"):
            EvictionConfig.from_dict({"method": name, "max_tokens": 256})
    finally:
        POLICIES[name] = cls


def test_none_means_off() -> None:
    assert config_from_additional({}) is None
    assert config_from_additional({"nexus": {"method": "none"}}) is None
    cfg = config_from_additional({"nexus": {"method": "tova", "max_tokens": 2048}})
    assert cfg is not None
    assert cfg.method == "tova" and budget_blocks(cfg, 10_000) == 64


@pytest.mark.parametrize("xargs, field", [
    ({"kv_budget": -1}, "kv_budget"), ({"kv_budget": 0}, "kv_budget"),
    ({"kv_budget": "12"}, "kv_budget"), ({"kv_budget": True}, "kv_budget"),
    ({"kv_budget": 1.5}, "kv_budget"), ({"kv_budget": 32}, "kv_budget"),
    ({"kv_eviction": "lru"}, "kv_eviction"), ({"kv_eviction": 3}, "kv_eviction"),
])
def test_request_validation_names_field(xargs, field) -> None:  # noqa: ANN001
    server = resolve_config(flags={"method": "nexus", "max_tokens": 2048})
    with pytest.raises(ValueError, match=f"vllm_xargs.{field}"):
        validate_request_args(xargs, server)


def test_request_overrides() -> None:
    server = resolve_config(flags={"method": "nexus", "keep_ratio": 0.25})
    validate_request_args({"kv_budget": 512.0, "kv_eviction": "snapkv"}, server)
    cfg = request_config(server, {"kv_budget": 512.0, "kv_eviction": "snapkv"})
    assert cfg is not None
    assert cfg.method == "snapkv" and cfg.max_tokens == 512 and cfg.keep_ratio is None
    assert request_config(server, {"kv_eviction": "none"}) is None
    assert request_config(server, {"unrelated": 1}) is server
    # A server without eviction rejects per-request eviction instead of ignoring it.
    with pytest.raises(ValueError, match="vllm_xargs.kv_budget"):
        validate_request_args({"kv_budget": 512}, None)
    validate_request_args({"kv_eviction": "none"}, None)


def test_prompt_mode_from_every_source(tmp_path) -> None:  # noqa: ANN001
    f = tmp_path / "end.yaml"
    f.write_text("nexus:\n  method: nexus\n  prompt_mode: end\n  prefill_budget: 2048\n")
    cfg = resolve_config(file=str(f), flags={"max_tokens": 1024})
    assert (cfg.prompt_mode, cfg.prefill_budget) == ("end", 2048)
    cfg = resolve_config(additional={"prompt_mode": "keep"}, flags={"max_tokens": 1024})
    assert (cfg.prompt_mode, cfg.prefill_budget) == ("keep", None)
    cfg = resolve_config(file=str(f), flags={"max_tokens": 1024, "prefill_budget": 1024})
    assert cfg.prefill_budget == 1024  # the flag wins
    assert config_from_additional({"nexus": cfg.to_dict()}) == cfg  # reaches every process
    with pytest.raises(ValueError, match="^--additional-config nexus: .*prompt_mode"):
        resolve_config(additional={"prompt_mode": "begin"}, flags={"max_tokens": 1024})
    with pytest.raises(ValueError, match="^--kv-eviction-config: .*prefill_budget"):
        f.write_text("prompt_mode: keep\nprefill_budget: 2048\n")
        resolve_config(file=str(f), flags={"max_tokens": 1024})


def test_evidence_knobs_from_every_source(tmp_path) -> None:  # noqa: ANN001
    """attention_reduce and carry (issue 27) reach the server from a preset or
    --additional-config, and a bad value fails at startup naming its source and field."""
    f = tmp_path / "mean.yaml"
    f.write_text("method: nexus\nhead_reduce: mean\ncarry: 0\n")
    cfg = resolve_config(file=str(f), flags={"max_tokens": 1024})
    assert (cfg.attention_reduce, cfg.carry) == ("mean", 0)
    default = resolve_config(flags={"max_tokens": 1024})
    assert (default.prompt_mode, default.attention_reduce, default.carry) == ("end", "max", 1)
    assert config_from_additional({"nexus": cfg.to_dict()}) == cfg  # reaches every process
    with pytest.raises(ValueError, match="^--additional-config nexus: .*attention_reduce"):
        resolve_config(additional={"attention_reduce": "sum"}, flags={"max_tokens": 1024})
    with pytest.raises(ValueError, match="^--additional-config nexus: .*carry"):
        resolve_config(additional={"carry": -1}, flags={"max_tokens": 1024})
    with pytest.raises(ValueError, match="^--kv-eviction-config: .*carry"):
        f.write_text("carry: 9\n")
        resolve_config(file=str(f), flags={"max_tokens": 1024})


def test_request_question_tokens_set_the_prompt_window() -> None:
    server = resolve_config(flags={"method": "nexus", "max_tokens": 256, "prompt_mode": "end"})
    assert request_config(server, {"kv_question_tokens": 12}).prompt_window == 12
    assert request_config(server, {"kv_question_tokens": 12.0}).prompt_window == 12
    assert request_config(server, {}).prompt_window == server.prompt_window == 32
    # The workers keep max(window, prompt_window) rows per request: no more can score.
    wide = server.replace(prompt_window=48)
    validate_request_args({"kv_question_tokens": 48}, wide)
    with pytest.raises(ValueError, match="^vllm_xargs.kv_question_tokens: 49 is above"):
        validate_request_args({"kv_question_tokens": 49}, wide)


def test_request_prompt_mode_overrides() -> None:
    end = resolve_config(flags={"method": "nexus", "max_tokens": 256, "prompt_mode": "end",
                                "prefill_budget": 1024})
    assert request_config(end, {}) is end
    cfg = request_config(end, {"kv_prompt_mode": "keep"})
    assert (cfg.prompt_mode, cfg.prefill_budget) == ("keep", None)  # end only: dropped
    cfg = request_config(end, {"kv_prompt_mode": "end"})
    assert (cfg.prompt_mode, cfg.prefill_budget) == ("end", 1024)  # the server's
    cfg = request_config(end, {"kv_prefill_budget": 4096.0})
    assert (cfg.prompt_mode, cfg.prefill_budget) == ("end", 4096)
    # A request's budget above the server's prefill budget is refused naming kv_budget.
    with pytest.raises(ValueError, match="^vllm_xargs.kv_budget: .*--kv-prefill-budget"):
        validate_request_args({"kv_budget": 2048}, end, max_model_len=4096)
    validate_request_args({"kv_budget": 2048, "kv_prefill_budget": 2048}, end,
                          max_model_len=4096)
    validate_request_args({"kv_budget": 2048, "kv_prompt_mode": "keep"}, end,
                          max_model_len=4096)
    stream = resolve_config(flags={"method": "nexus", "max_tokens": 256})
    cfg = request_config(stream, {"kv_prompt_mode": "end", "kv_prefill_budget": 512})
    assert (cfg.prompt_mode, cfg.prefill_budget, cfg.max_tokens) == ("end", 512, 256)
    assert request_config(stream, {"kv_eviction": "none", "kv_prompt_mode": "keep"}) is None


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
class TestServeParser:
    """The real ``vllm serve`` parser with the plugin's flags."""

    @staticmethod
    def _parser():  # noqa: ANN205
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        import nexus_vllm

        nexus_vllm.register()
        return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))

    @pytest.mark.parametrize("argv, flag", [
        (["--kv-eviction", "bogus"], "--kv-eviction"),
        (["--kv-budget", "-3"], "--kv-budget"),
        (["--kv-budget", "many"], "--kv-budget"),
        (["--kv-keep-ratio", "2"], "--kv-keep-ratio"),
        (["--kv-eviction-seed", "-1"], "--kv-eviction-seed"),
        (["--kv-chunk-size", "0"], "--kv-chunk-size"),
        (["--kv-prompt-mode", "begin"], "--kv-prompt-mode"),
        (["--kv-prefill-budget", "0"], "--kv-prefill-budget"),
        (["--kv-prefill-budget", "lots"], "--kv-prefill-budget"),
    ])
    def test_argparse_rejects(self, argv, flag, capsys) -> None:  # noqa: ANN001
        with pytest.raises(SystemExit):
            self._parser().parse_args(["--model", LOCAL_MODEL, *argv])
        assert flag in capsys.readouterr().err

    def test_from_cli_args_and_translation(self, tmp_path) -> None:  # noqa: ANN001
        from vllm.engine.arg_utils import AsyncEngineArgs

        from nexus_vllm.integration.frontend.patches.engine_args import translate_engine_args

        preset = tmp_path / "p.yaml"
        preset.write_text("window: 8\nmethod: h2o\n")
        args = self._parser().parse_args([
            "--model", LOCAL_MODEL, "--kv-budget", "1024", "--kv-eviction-config", str(preset),
            "--additional-config", '{"nexus": {"window": 4, "interval": 8}}',
        ])
        ea = AsyncEngineArgs.from_cli_args(args)
        nexus = ea.additional_config["nexus"]
        assert (nexus["method"], nexus["window"], nexus["interval"], nexus["max_tokens"]) == (
            "h2o", 4, 8, 1024)
        cfg = translate_engine_args(ea)
        assert cfg is not None
        assert ea.scheduler_cls == "nexus_vllm.integration.scheduler.scheduler.NexusScheduler"
        assert ea.worker_cls == "nexus_vllm.integration.worker.worker.NexusWorker"
        assert ea.enable_prefix_caching is None and ea.block_size == 32  # left to vLLM
        # The default mode evicts at the prompt's end only: vLLM chunks the prompt as it
        # would (no per-request cap); stream caps each request at --kv-chunk-size. Async
        # scheduling is left to vLLM; the scheduler class follows what it settles on.
        assert ea.long_prefill_token_threshold == 0 and ea.async_scheduling is None
        stream = AsyncEngineArgs.from_cli_args(self._parser().parse_args([
            "--model", LOCAL_MODEL, "--kv-eviction", "nexus", "--kv-budget", "1024",
            "--kv-prompt-mode", "stream"]))
        translate_engine_args(stream)
        assert stream.long_prefill_token_threshold == 512

    def test_prompt_mode_flags(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs

        args = self._parser().parse_args([
            "--model", LOCAL_MODEL, "--kv-eviction", "nexus", "--kv-budget", "1024",
            "--kv-prompt-mode", "end", "--kv-prefill-budget", "4096"])
        nexus = AsyncEngineArgs.from_cli_args(args).additional_config["nexus"]
        assert (nexus["prompt_mode"], nexus["prefill_budget"]) == ("end", 4096)
        args = self._parser().parse_args(["--model", LOCAL_MODEL, "--kv-budget", "1024",
                                          "--kv-prompt-mode", "keep"])
        nexus = AsyncEngineArgs.from_cli_args(args).additional_config["nexus"]
        assert (nexus["prompt_mode"], nexus["prefill_budget"]) == ("keep", None)

    @pytest.mark.parametrize("argv, flag", [
        (["--kv-prompt-mode", "end", "--kv-prefill-budget", "512"], "--kv-prefill-budget"),
        (["--kv-prompt-mode", "keep", "--kv-prefill-budget", "2048"], "--kv-prefill-budget"),
        (["--kv-prompt-mode", "stream", "--kv-prefill-budget", "2048"],
         "--kv-prefill-budget"),  # end only
        (["--additional-config", '{"nexus": {"prompt_mode": "end", "prefill_budget": 2048}}',
          "--kv-prompt-mode", "keep"], "--kv-prompt-mode"),
    ])
    def test_prompt_mode_cross_field_errors_name_the_flag(self, argv, flag) -> None:  # noqa: ANN001
        from vllm.engine.arg_utils import AsyncEngineArgs

        args = self._parser().parse_args(["--model", LOCAL_MODEL, "--kv-eviction", "nexus",
                                          "--kv-budget", "1024", *argv])
        with pytest.raises(SystemExit, match=f"^vllm serve: error: {flag}: .*prefill_budget"):
            AsyncEngineArgs.from_cli_args(args)

    def test_cross_field_error_exits_naming_flag(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs

        args = self._parser().parse_args(["--model", LOCAL_MODEL, "--kv-eviction", "nexus"])
        with pytest.raises(SystemExit, match="--kv-budget"):
            AsyncEngineArgs.from_cli_args(args)

    def test_off_changes_nothing(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs

        from nexus_vllm.integration.frontend.patches.engine_args import translate_engine_args

        for argv in ([], ["--kv-eviction", "none"]):
            ea = AsyncEngineArgs.from_cli_args(self._parser().parse_args(["--model", LOCAL_MODEL,
                                                                          *argv]))
            assert "nexus" not in (ea.additional_config or {})
            assert translate_engine_args(ea) is None
            assert ea.scheduler_cls in (None, "vllm.v1.core.sched.scheduler.Scheduler")
            assert ea.worker_cls == "auto"


@pytest.mark.parametrize("preset", sorted(
    p.name for p in (pathlib.Path(__file__).parents[2] / "configs").glob("*.yaml")
    if p.name not in ("nexus-keep20.yaml", "nexus-fast.yaml", "nexus-end.yaml",
                      "nexus-chat.yaml", "nexus-completion.yaml", "nexus-stream.yaml")
))
def test_presets_load(preset) -> None:  # noqa: ANN001
    path = pathlib.Path(__file__).parents[2] / "configs" / preset
    cfg = resolve_config(file=str(path), flags={"max_tokens": 2048})
    assert cfg.method == preset.removesuffix(".yaml") and cfg.max_tokens == 2048


def test_end_preset_holds_the_budget_from_the_prompt_end() -> None:
    path = pathlib.Path(__file__).parents[2] / "configs" / "nexus-end.yaml"
    cfg = resolve_config(file=str(path), flags={"max_tokens": 2048})
    assert (cfg.method, cfg.prompt_mode, cfg.prefill_budget) == ("nexus", "end", None)
    prompt_end = cfg.event_policies().prefill
    assert (prompt_end.indirect, prompt_end.sampler) == ("none", "topk")  # the tuned event
    assert cfg.event_policies().decode.sampler == "pps"  # decode events keep the paper's sampler


def test_shape_presets() -> None:
    """One preset per prompt shape (the chat shape's is the defaults) and the streaming
    setting."""
    from nexus_vllm.core import EvictionConfig

    configs = pathlib.Path(__file__).parents[2] / "configs"
    chat = resolve_config(file=str(configs / "nexus-chat.yaml"), flags={"max_tokens": 2048})
    assert chat == EvictionConfig(method="nexus", max_tokens=2048)
    completion = resolve_config(file=str(configs / "nexus-completion.yaml"),
                                flags={"max_tokens": 2048})
    assert completion == chat.replace(prompt_window=8)
    stream = resolve_config(file=str(configs / "nexus-stream.yaml"), flags={"max_tokens": 2048})
    assert stream == chat.replace(prompt_mode="stream")
    spelled = resolve_config(file=str(configs / "nexus.yaml"), flags={"max_tokens": 2048})
    assert spelled.replace(policy_args={}) == chat  # the policy's knobs, written out
    assert spelled.event_policies() == chat.event_policies()


def test_fast_preset_scores_a_quarter() -> None:
    path = pathlib.Path(__file__).parents[2] / "configs" / "nexus-fast.yaml"
    cfg = resolve_config(file=str(path), flags={"max_tokens": 2048})
    assert cfg.method == "nexus" and cfg.prompt_window == 16
    assert list(cfg.scored_layers(30)) == list(range(2, 30, 2))


def test_keep_ratio_preset() -> None:
    path = pathlib.Path(__file__).parents[2] / "configs" / "nexus-keep20.yaml"
    cfg = resolve_config(file=str(path))
    assert cfg.keep_ratio == 0.2 and budget_blocks(cfg, 32 * 100) == 20


def test_serve_command_defaults(monkeypatch) -> None:  # noqa: ANN001
    from nexus_vllm.integration.frontend.serve import build_command

    for var in ("NEXUS_VLLM_HOST", "NEXUS_VLLM_PORT", "NEXUS_VLLM_KV_BUDGET",
                "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(var, raising=False)
    cmd, env = build_command(["some/model", "--port", "9000"], gpu=False)
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "some/model"]
    joined = " ".join(cmd)
    assert "--kv-eviction nexus --kv-budget 2048" in joined
    assert "--host 127.0.0.1" in joined and joined.count("--port") == 1
    assert "--enforce-eager" in joined and "--distributed-executor-backend uni" in joined
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
    cmd, env = build_command(["m", "--kv-eviction", "h2o", "--kv-budget", "64",
                              "--dtype", "bfloat16"], gpu=True)
    assert cmd.count("--kv-eviction") == 1 and "--enforce-eager" not in cmd and env == {}
    assert cmd.count("--dtype") == 1
    with pytest.raises(SystemExit, match="model name"):
        build_command([], gpu=True)


def test_serve_command_maps_a_prepared_models_name(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """``nexus-vllm serve gemma3`` serves the prepared checkpoint under its canonical name
    (a hub-style name passes through untouched)."""
    import nexus_vllm.models
    from nexus_vllm.integration.frontend.serve import build_command

    prepared: list[str] = []
    monkeypatch.setattr(nexus_vllm.models, "prepare_model",
                        lambda name: prepared.append(name) or tmp_path / name)
    cmd, _ = build_command(["gemma3", "--kv-eviction", "none"], gpu=False)
    assert prepared == ["gemma3-270m"] and cmd[4] == str(tmp_path / "gemma3-270m")
    assert cmd[cmd.index("--served-model-name") + 1] == "gemma3-270m"
    cmd, _ = build_command(["google/gemma-3-270m", "--kv-eviction", "none"], gpu=False)
    assert cmd[4] == "google/gemma-3-270m" and "--served-model-name" not in cmd


def test_serve_dry_run_prints_the_event_policies(monkeypatch, capsys) -> None:  # noqa: ANN001
    from nexus_vllm.integration.frontend import serve

    monkeypatch.setenv("NEXUS_VLLM_DEVICE", "cuda")
    assert serve.main(["some/model", "--kv-eviction-config", "nexus-stream", "--kv-budget",
                       "1024", "--block-size", "16", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[nexus-vllm] ") and "--dry-run" not in out[0]
    assert "prompt_mode stream" in out[1]
    cfg = resolve_config(file="nexus-stream", flags={"max_tokens": 1024, "block_size": 16})
    assert "\n".join(out[2:]) == cfg.event_policies().table()
    assert serve.main(["some/model", "--kv-eviction", "none", "--dry-run"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1  # no eviction: no table
    assert serve.main(["some/model", "--kv-eviction", "nexus", "--dry-run"]) == 2
    assert "--kv-budget" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_vllm_config_yaml_sets_plugin_flags(tmp_path) -> None:  # noqa: ANN001
    from vllm.engine.arg_utils import AsyncEngineArgs

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("kv-eviction: snapkv\nkv-budget: 4096\nkv-chunk-size: 256\n")
    args = TestServeParser._parser().parse_args(["--model", LOCAL_MODEL, "--config", str(cfg)])
    nexus = AsyncEngineArgs.from_cli_args(args).additional_config["nexus"]
    assert (nexus["method"], nexus["max_tokens"], nexus["chunk_size"]) == ("snapkv", 4096, 256)


# -- presets by name (--kv-eviction-config NAME; nexus_vllm.presets) --------------------
PRESETS = pathlib.Path(__file__).parents[2] / "configs"


@pytest.mark.parametrize("preset", sorted(p.name for p in PRESETS.glob("*.yaml")))
def test_presets_load_by_name(preset, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)  # no file of that name here: the name is looked up
    by_path = load_config_file(PRESETS / preset)
    assert load_config_file(preset) == by_path
    assert load_config_file(preset.removesuffix(".yaml")) == by_path


def test_an_existing_path_wins_over_a_preset(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nexus-fast.yaml").write_text("method: h2o\n")
    assert load_config_file("nexus-fast.yaml") == {"method": "h2o"}
    assert load_config_file("nexus-fast")["method"] == "nexus"  # no file "nexus-fast"
    cfg = resolve_config(file="nexus-fast", flags={"max_tokens": 2048})
    assert (cfg.prompt_window, cfg.layer_stride, cfg.max_tokens) == (16, 2, 2048)


def test_an_unknown_preset_names_the_flag_and_lists_the_presets(tmp_path,
                                                                monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as err:
        resolve_config(file="nexus-fats", flags={"max_tokens": 2048})
    msg = str(err.value)
    assert msg.startswith("--kv-eviction-config: no such file or preset 'nexus-fats'"), msg
    assert "did you mean 'nexus-fast'" in msg
    names = sorted(p.name.removesuffix(".yaml") for p in PRESETS.glob("*.yaml"))
    assert f"presets: {', '.join(names)} " in msg
    assert "ci" not in names and "ci" not in msg.split("presets: ")[1]  # configs/eval/
    # A path (not a bare name) is never looked up among the presets.
    for path in ("configs/nexus-fast.yaml", "sub/nexus-fast", "eval/ci.yaml"):
        with pytest.raises(ValueError, match=r"^--kv-eviction-config: no such file '") as err:
            load_config_file(path)
        assert "presets:" not in str(err.value)


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_vllm_serve_takes_a_preset_by_name(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from vllm.engine.arg_utils import AsyncEngineArgs

    monkeypatch.chdir(tmp_path)
    args = TestServeParser._parser().parse_args(
        ["--model", LOCAL_MODEL, "--kv-eviction-config", "nexus-fast", "--kv-budget", "2048"])
    nexus = AsyncEngineArgs.from_cli_args(args).additional_config["nexus"]
    assert (nexus["method"], nexus["prompt_window"], nexus["layer_stride"],
            nexus["max_tokens"]) == ("nexus", 16, 2, 2048)
    args = TestServeParser._parser().parse_args(
        ["--model", LOCAL_MODEL, "--kv-eviction-config", "nexus-fats", "--kv-budget", "2048"])
    with pytest.raises(SystemExit, match="^vllm serve: error: --kv-eviction-config: no such "
                                         "file or preset 'nexus-fats'.*presets: h2o, nexus"):
        AsyncEngineArgs.from_cli_args(args)


def test_a_layer_knob_is_checked_against_the_flag_method() -> None:
    """A policy knob in --additional-config is checked against the method that will run
    (--kv-eviction's), so the error names the layer that holds the knob."""
    with pytest.raises(ValueError, match="^--additional-config nexus: steps: a knob of "
                                         "policy 'nexus', not of method 'h2o'"):
        resolve_config(additional={"steps": 5}, flags={"method": "h2o", "max_tokens": 512})
    cfg = resolve_config(additional={"method": "h2o"}, flags={"method": "nexus",
                                                              "max_tokens": 512})
    assert cfg.method == "nexus"


@pytest.mark.parametrize("additional, knob", [
    ({"expected": 2}, "expected must be <= 1.0"),
    ({"prefill_expected": -1}, "prefill_expected must be >= 0.0"),
    ({"knorm_prior": "strong"}, "knorm_prior"),
])
def test_bad_evidence_knobs_name_the_flag_and_the_knob(additional, knob) -> None:  # noqa: ANN001
    """The streaming-regime knobs fail at startup like every other: the flag they came
    with, then the knob."""
    with pytest.raises(ValueError, match=f"^--additional-config nexus: {knob}"):
        resolve_config(additional=additional, flags={"method": "nexus", "max_tokens": 1024})
