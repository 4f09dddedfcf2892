"""Bad input everywhere is refused with a message naming the field and what is allowed.

Per-request ``vllm_xargs`` (wrong types, NaN/inf, negative, zero, below the forced-set
floor, above ``max_model_len``, unknown methods, unknown ``kv_*`` keys), the ``--kv-*``
flags, ``--kv-eviction-config`` files and ``--additional-config '{"nexus": ...}'``.

* Unit tables (seconds): ``validate_request_args``, ``resolve_config``, the argparse
  types, the two request hooks, and vLLM's ``create_engine_config`` on the tiny model
  (the checks that need ``max_model_len``).
* One evicting server (``--kv-eviction nexus --kv-budget 256 --kv-chunk-size 128``)
  fuzzed over HTTP with raw JSON: each bad case, on the three endpoints that carry
  ``vllm_xargs`` (``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``),
  streamed and not, is an HTTP 400 before any stream; the server keeps serving and logs
  no ERROR or traceback.
* A few real ``vllm serve`` startups: one clean error line naming the flag, no traceback.
"""

from __future__ import annotations

import argparse
import inspect
import json
import pathlib
import re
import subprocess
import types

import pytest

from nexus_vllm.core.policies import POLICIES
from nexus_vllm.integration.frontend.request_args import RequestArgError, validate_request_args
from nexus_vllm.integration.frontend.server_config import METHODS, add_cli_flags, resolve_config
from tests.integration.conftest import HAS_VLLM

needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

NAN, INF = float("nan"), float("inf")
MAX_LEN = 4096  # nexus_vllm.eval.server.CPU_FLAGS
# The least --kv-budget with the default forced set: (1 sink + 2 recent + 1 current) * 32.
FLOOR = 128


def _server_cfg():  # noqa: ANN202
    # A streaming server: the mode the prompt-mode cases below are refused against.
    return resolve_config(flags={"method": "nexus", "max_tokens": 256, "prompt_mode": "stream"})


# -- per-request vllm_xargs -------------------------------------------------------------
POSITIVE = "must be a positive integer number of tokens"
ONE_OF = f"must be one of {', '.join(METHODS)}"
UNKNOWN = "unknown per-request field"
MODES = "must be one of stream, end, keep"

# (vllm_xargs, field named in the message, part of the message saying what is allowed)
REQUEST_CASES = [
    ({"kv_budget": -1}, "kv_budget", f"{POSITIVE}; got -1"),
    ({"kv_budget": 0}, "kv_budget", f"{POSITIVE}; got 0"),
    ({"kv_budget": "256"}, "kv_budget", f"{POSITIVE}; got '256' (a string)"),
    ({"kv_budget": True}, "kv_budget", "got True (a boolean)"),
    ({"kv_budget": False}, "kv_budget", "got False (a boolean)"),
    ({"kv_budget": 256.5}, "kv_budget", f"{POSITIVE}; got 256.5"),
    ({"kv_budget": NAN}, "kv_budget", f"{POSITIVE}; got nan"),
    ({"kv_budget": INF}, "kv_budget", f"{POSITIVE}; got inf"),
    ({"kv_budget": -INF}, "kv_budget", f"{POSITIVE}; got -inf"),
    ({"kv_budget": [256]}, "kv_budget", "got [256] (a list)"),
    ({"kv_budget": None}, "kv_budget", "got None (null)"),
    ({"kv_budget": {"tokens": 256}}, "kv_budget", "(an object)"),
    ({"kv_budget": 32}, "kv_budget", f"at least {FLOOR} tokens"),
    ({"kv_budget": FLOOR - 1}, "kv_budget", f"allowed: {FLOOR}..{MAX_LEN}; got {FLOOR - 1}"),
    ({"kv_budget": MAX_LEN + 1}, "kv_budget", f"max model length ({MAX_LEN} tokens)"),
    ({"kv_budget": 100_000}, "kv_budget", 'or send "kv_eviction": "none"'),
    ({"kv_budget": 10**30}, "kv_budget", f"{10**30} is above"),
    ({"kv_budget": 10**60}, "kv_budget", "... (61 characters) is above"),
    ({"kv_budget": 1e300}, "kv_budget", "1e+300 is above"),
    ({"kv_eviction": "lru"}, "kv_eviction", f"{ONE_OF}; got 'lru' (a string)"),
    ({"kv_eviction": "NEXUS"}, "kv_eviction", "did you mean 'nexus'?"),
    ({"kv_eviction": "knorM"}, "kv_eviction", "did you mean 'knorm'"),
    ({"kv_eviction": ""}, "kv_eviction", ONE_OF),
    ({"kv_eviction": 3}, "kv_eviction", f"{ONE_OF}; got 3"),
    ({"kv_eviction": None}, "kv_eviction", ONE_OF),
    ({"kv_eviction": ["nexus"]}, "kv_eviction", "(a list)"),
    ({"kv_budjet": 256}, "kv_budjet", f"{UNKNOWN} (did you mean 'kv_budget'?)"),
    ({"KV_BUDGET": 256}, "KV_BUDGET", "did you mean 'kv_budget'?"),
    ({"kv-budget": 256}, "kv-budget", "did you mean 'kv_budget'?"),
    ({"kv_evicton": "h2o"}, "kv_evicton", "did you mean 'kv_eviction'?"),
    ({"kv_keep_ratio": 0.5}, "kv_keep_ratio", "set per server with --kv-keep-ratio"),
    ({"kv_chunk_size": 64}, "kv_chunk_size", "set per server with --kv-chunk-size"),
    ({"nexus": 4}, "nexus", "per-request fields: kv_budget, kv_eviction"),
    ({"nexus_budget": 256}, "nexus_budget", "did you mean 'kv_budget'?"),
    # A typo next to a good field is still a typo.
    ({"kv_budget": 512, "kv_budjet": 256}, "kv_budjet", UNKNOWN),
    ({"kv_prompt_mode": "begin"}, "kv_prompt_mode",
     f"{MODES}; got 'begin' (a string)"),
    ({"kv_prompt_mode": "END"}, "kv_prompt_mode", "did you mean 'end'?"),
    ({"kv_prompt_mode": 1}, "kv_prompt_mode", f"{MODES}; got 1"),
    ({"kv_prompt_mode": None}, "kv_prompt_mode", MODES),
    ({"kv_promt_mode": "end"}, "kv_promt_mode", "did you mean 'kv_prompt_mode'?"),
    ({"kv_prefill_budget": 1024}, "kv_prefill_budget",
     "applies to kv_prompt_mode 'end' only; this server's prompt mode (--kv-prompt-mode) "
     "is 'stream'"),
    ({"kv_prefill_budget": 1024, "kv_prompt_mode": "keep"}, "kv_prefill_budget",
     "this request's kv_prompt_mode is 'keep'"),
    ({"kv_prefill_budget": 128, "kv_prompt_mode": "end"}, "kv_prefill_budget",
     "must be at least the budget (256 tokens, this server's --kv-budget); got 128"),
    ({"kv_prefill_budget": 512, "kv_prompt_mode": "end", "kv_budget": 1024},
     "kv_prefill_budget", "at least the budget (1024 tokens, this request's kv_budget)"),
    ({"kv_prefill_budget": "1024", "kv_prompt_mode": "end"}, "kv_prefill_budget",
     f"{POSITIVE}; got '1024' (a string)"),
    ({"kv_prefill_budget": 1024.5, "kv_prompt_mode": "end"}, "kv_prefill_budget", POSITIVE),
    ({"kv_prefill_budget": 0, "kv_prompt_mode": "end"}, "kv_prefill_budget", POSITIVE),
    ({"kv_prefill_budget": NAN, "kv_prompt_mode": "end"}, "kv_prefill_budget", "got nan"),
    ({"kv_prefill_budget": True, "kv_prompt_mode": "end"}, "kv_prefill_budget",
     "(a boolean)"),
    ({"kv_question_tokens": 0}, "kv_question_tokens", POSITIVE),
    ({"kv_question_tokens": "12"}, "kv_question_tokens", f"{POSITIVE}; got '12'"),
    ({"kv_question_tokens": 12.5}, "kv_question_tokens", POSITIVE),
    ({"kv_question_tokens": 33}, "kv_question_tokens",
     "33 is above the 32 query rows this server keeps per request"),
    ({"kv_question_tokens": 10**9}, "kv_question_tokens", "allowed: 1..32"),
    ({"kv_question_tokenz": 12}, "kv_question_tokenz", "did you mean 'kv_question_tokens'?"),
    # A policy with a per-head score only: the server pages blocks.
    ({"kv_eviction": "reconstruction"}, "kv_eviction", "needs granularity 'head'"),
]
# On a server started with --kv-eviction none.
OFF_SERVER_CASES = [
    ({"kv_budget": 256}, "kv_budget", "started with --kv-eviction none"),
    ({"kv_eviction": "h2o"}, "kv_eviction", "only 'none' is allowed"),
    ({"kv_budjet": 256}, "kv_budjet", "did you mean 'kv_budget'?"),
    ({"kv_budget": "256"}, "kv_budget", POSITIVE),
    ({"kv_prompt_mode": "end"}, "kv_prompt_mode", "started with --kv-eviction none"),
    ({"kv_prompt_mode": "end", "kv_prefill_budget": 1024}, "kv_prompt_mode",
     "started with --kv-eviction none"),
    ({"kv_question_tokens": 12}, "kv_question_tokens", "started with --kv-eviction none"),
]
GOOD_XARGS = [
    {"kv_budget": FLOOR}, {"kv_budget": MAX_LEN}, {"kv_budget": 512.0},
    *({"kv_eviction": m} for m in METHODS if m == "none" or not POLICIES[m].head_only),
    {"kv_eviction": "h2o", "kv_budget": 1024},
    {"kv_eviction": "none", "kv_budget": 10**9},  # opted out: the budget is moot
    {"kv_prompt_mode": "stream"}, {"kv_prompt_mode": "end"}, {"kv_prompt_mode": "keep"},
    {"kv_prompt_mode": "end", "kv_prefill_budget": 256},
    # Above the max model length: it never binds (the whole prompt is kept), allowed.
    {"kv_prompt_mode": "end", "kv_prefill_budget": 10**6},
    {"kv_prompt_mode": "end", "kv_prefill_budget": 2048.0, "kv_budget": 1024},
    {"kv_eviction": "none", "kv_prompt_mode": "keep", "kv_prefill_budget": 5},
    {"kv_question_tokens": 1}, {"kv_question_tokens": 32.0},
    {"kv_prompt_mode": "end", "kv_question_tokens": 12},
    # Other plugins' keys, and vLLM's own kv_transfer_params, pass untouched.
    {"session_id": "s", "kv_transfer_params": {"do_remote_prefill": False},
     "kvpress_ratio": 0.5, "my_logits_processor": [1, 2]},
]


def _ids(cases: list) -> list[str]:
    return [json.dumps(c[0], default=str)[:60] for c in cases]


@pytest.mark.parametrize("xargs, field, allowed", REQUEST_CASES, ids=_ids(REQUEST_CASES))
def test_request_field_refused(xargs, field, allowed) -> None:  # noqa: ANN001
    with pytest.raises(RequestArgError) as err:
        validate_request_args(xargs, _server_cfg(), max_model_len=MAX_LEN)
    assert err.value.field == f"vllm_xargs.{field}"
    assert str(err.value).startswith(f"vllm_xargs.{field}: ")
    assert allowed in str(err.value)


@pytest.mark.parametrize("xargs, field, allowed", OFF_SERVER_CASES,
                         ids=_ids(OFF_SERVER_CASES))
def test_request_field_refused_by_server_without_eviction(xargs, field,
                                                          allowed) -> None:  # noqa: ANN001
    with pytest.raises(RequestArgError, match=f"^vllm_xargs.{field}: .*{allowed}"):
        validate_request_args(xargs, None, max_model_len=MAX_LEN)


@pytest.mark.parametrize("xargs", GOOD_XARGS, ids=[json.dumps(x)[:60] for x in GOOD_XARGS])
def test_good_request_fields_pass(xargs) -> None:  # noqa: ANN001
    validate_request_args(xargs, _server_cfg(), max_model_len=MAX_LEN)
    # ... and on a server with the defaults (prompt mode end).
    default = resolve_config(flags={"method": "nexus", "max_tokens": 256})
    validate_request_args(xargs, default, max_model_len=MAX_LEN)


def test_prefill_budget_alone_is_good_on_a_default_server() -> None:
    """The default mode is end, so a request's prefill budget needs no mode with it."""
    default = resolve_config(flags={"method": "nexus", "max_tokens": 256})
    validate_request_args({"kv_prefill_budget": 1024}, default, max_model_len=MAX_LEN)


def test_rules_between_request_fields_are_eviction_configs(monkeypatch) -> None:  # noqa: ANN001
    """The budget floor and the prefill budget's rules are ``EvictionConfig``'s, not
    restated for requests: with its checks switched off, requests that break them pass,
    while what only a request has (JSON types, unknown keys, the model's length, a server
    without eviction) is still refused."""
    from nexus_vllm.core import EvictionConfig

    server = _server_cfg()
    monkeypatch.setattr(EvictionConfig, "__post_init__", lambda self: None)
    for xargs in ({"kv_budget": 32}, {"kv_prefill_budget": 1024},
                  {"kv_prompt_mode": "end", "kv_prefill_budget": 64}):
        validate_request_args(xargs, server, max_model_len=MAX_LEN)
    for xargs, field in (({"kv_budget": "256"}, "kv_budget"), ({"kv_budjet": 1}, "kv_budjet"),
                         ({"kv_budget": MAX_LEN + 1}, "kv_budget")):
        with pytest.raises(RequestArgError, match=f"^vllm_xargs.{field}: "):
            validate_request_args(xargs, server, max_model_len=MAX_LEN)
    with pytest.raises(RequestArgError, match="^vllm_xargs.kv_budget: .*eviction none"):
        validate_request_args({"kv_budget": 32}, None)


def test_good_request_fields_pass_without_eviction() -> None:
    for xargs in ({"kv_eviction": "none"}, {"session_id": "s"}, None, {}):
        validate_request_args(xargs, None, max_model_len=MAX_LEN)


# -- config files and --additional-config ----------------------------------------------
# key -> lowest allowed value (EvictionConfig)
_INT_KEYS = {"max_tokens": FLOOR, "block_size": 1, "sink_blocks": 1, "recent_blocks": 0,
             "interval": 1, "window": 1, "prompt_window": 1, "chunk_size": 1,
             "skip_layers": 0, "steps": 1, "n": 1}
_NOT_INTS = ["8", 8.0, 1.5, True, NAN, INF, [8]]
_CHOICE_KEYS = ("method", "direct", "prefill_direct", "indirect", "prefill_indirect",
                "walk_rows", "sampler")
# (key, bad value): the message must name the key.
CONFIG_CASES = [
    *((k, v) for k in _INT_KEYS for v in _NOT_INTS),
    *((k, low - 1) for k, low in _INT_KEYS.items()),
    *((k, -(10**30)) for k in _INT_KEYS),
    ("seed", "1"), ("seed", 1.5), ("seed", True), ("seed", NAN),
    ("lam", "0.5"), ("lam", True), ("lam", NAN), ("lam", INF), ("lam", -0.5),
    ("keep_ratio", 0), ("keep_ratio", -0.5), ("keep_ratio", 1.5), ("keep_ratio", NAN),
    ("keep_ratio", INF), ("keep_ratio", "0.5"), ("keep_ratio", True),
    # None for a prefill_ knob: the prompt mode's default.
    *((k, v) for k in _CHOICE_KEYS for v in ("bogus", 3, None)
      if (k, v) not in (("prefill_indirect", None), ("prefill_direct", None))),
    ("prefill_sampler", "bogus"), ("prefill_sampler", 3),
    ("prompt_mode", "begin"), ("prompt_mode", None), ("prefill_budget", "1024"),
    ("prefill_budget", 1.5), ("prefill_budget", 512),  # stream mode: end only
    ("method", "h20"),  # a typo of a served method
]


@pytest.mark.parametrize("key, value", CONFIG_CASES,
                         ids=[f"{k}={v!r}"[:40] for k, v in CONFIG_CASES])
def test_additional_config_value_refused(key, value) -> None:  # noqa: ANN001
    knobs = {"method": "nexus"} if key in ("max_tokens", "keep_ratio") else {
        "method": "nexus", "max_tokens": 1024}
    with pytest.raises(ValueError) as err:
        resolve_config(additional={**knobs, key: value})
    msg = str(err.value)
    assert msg.startswith(("--additional-config nexus: ", "nexus.method: ")), msg
    assert key in msg, msg


@pytest.mark.parametrize("additional", [0, "", [], "nexus", 5, [{"window": 8}]])
def test_additional_config_must_be_an_object(additional) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="^--additional-config: 'nexus' must be a JSON "
                                         "object of eviction knobs; got"):
        resolve_config(additional=additional, flags={"max_tokens": 1024})


# (file name, content, part of the message)
FILE_CASES = [
    ("a.yaml", "window: .nan\n", "window must be an int; got nan"),
    ("b.yaml", "lam: .inf\n", "lam must be a finite number; got inf"),
    ("c.yaml", "nexus:\n  wnidow: 3\n", "did you mean 'window' for 'wnidow'?"),
    ("d.yaml", "- 1\n- 2\n", "must hold a mapping of knobs"),
    ("e.yaml", "nexus: 5\n", "must hold a mapping of knobs"),
    ("f.yaml", "1: 2\nnull: 3\n", "unknown eviction config key(s) [1, None]"),
    ("g.yaml", "window: [8\n", "cannot parse"),
    ("h.json", '{"max_tokens": 1e3}', "max_tokens must be an int; got 1000.0"),
    ("i.json", '{"chunk_size": NaN}', "chunk_size must be an int; got nan"),
    ("j.json", '{"steps": 1.5}', "steps must be an int; got 1.5"),
    ("k.json", '{"method": "nexus",', "cannot parse"),
]


@pytest.mark.parametrize("name, content, fragment", FILE_CASES,
                         ids=[c[0] for c in FILE_CASES])
def test_config_file_refused(tmp_path, name, content, fragment) -> None:  # noqa: ANN001
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError) as err:
        resolve_config(file=str(path), flags={"max_tokens": 1024})
    assert str(err.value).startswith("--kv-eviction-config: "), str(err.value)
    assert fragment in str(err.value)


# -- flags: argparse types --------------------------------------------------------------
FLAG_CASES = [
    *((["--kv-budget", v], "--kv-budget")
      for v in ("nan", "inf", "-1", "0", "256.5", "256.0", "1e3", "", "many", "true",
                "0x100")),
    *((["--kv-keep-ratio", v], "--kv-keep-ratio")
      for v in ("nan", "inf", "-inf", "0", "-0.5", "1.5", "1e-400", "half", "")),
    *((["--kv-eviction-seed", v], "--kv-eviction-seed")
      for v in ("-1", "1.5", "nan", "inf", "seven")),
    *((["--kv-chunk-size", v], "--kv-chunk-size")
      for v in ("0", "-128", "1.5", "nan", "inf", "big")),
    *((["--kv-eviction", v], "--kv-eviction") for v in ("lru", "NEXUS", "knrom", "", "1")),
    *((["--kv-prompt-mode", v], "--kv-prompt-mode") for v in ("begin", "END", "", "1")),
    *((["--kv-prefill-budget", v], "--kv-prefill-budget")
      for v in ("0", "-1", "1.5", "nan", "inf", "all")),
]
GOOD_FLAGS = [["--kv-budget", "4096"], ["--kv-keep-ratio", "1"], ["--kv-keep-ratio", "0.25"],
              ["--kv-eviction-seed", "0"], ["--kv-chunk-size", "1"], ["--kv-eviction", "none"],
              ["--kv-prompt-mode", "end"], ["--kv-prompt-mode", "keep"],
              ["--kv-prefill-budget", "100000"]]


def _nexus_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm serve")
    add_cli_flags(parser)
    return parser


@pytest.mark.parametrize("argv, flag", FLAG_CASES, ids=[" ".join(a) for a, _ in FLAG_CASES])
def test_flag_refused_by_argparse(argv, flag, capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit):
        _nexus_parser().parse_args(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and f"argument {flag}:" in lines[0], err
    if (flag not in ("--kv-eviction", "--kv-prompt-mode") and argv[1]
            and not argv[1].startswith("-inf")):
        assert "must be" in lines[0] and repr(argv[1]) in lines[0], err


@pytest.mark.parametrize("argv", GOOD_FLAGS, ids=[" ".join(a) for a in GOOD_FLAGS])
def test_good_flags_parse(argv) -> None:  # noqa: ANN001
    _nexus_parser().parse_args(argv)


# -- checks that need the model: vLLM's create_engine_config on the tiny model ----------
BASE_ARGV = ["--max-model-len", str(MAX_LEN), "--kv-eviction", "nexus"]
# (extra argv, the flag or key the one-line error must name)
BUILD_CASES = [
    (["--kv-budget", str(MAX_LEN + 1)], "--kv-budget 4097 is above --max-model-len 4096"),
    (["--kv-budget", "1" + "0" * 30], "--kv-budget"),
    (["--kv-chunk-size", str(MAX_LEN + 1), "--kv-budget", "256"],
     "--kv-chunk-size 4097 is above --max-model-len 4096"),
    (["--kv-budget", "192", "--block-size", "64"], "--kv-budget: max_tokens must be >="),
    (["--kv-keep-ratio", "0.5", "--additional-config", '{"nexus": {"block_size": 2048}}'],
     "nexus.block_size 2048"),
    (["--kv-budget", "256", "--additional-config", '{"nexus": {"window": 5000}}'],
     "nexus.window 5000"),
    (["--kv-budget", "256", "--additional-config", '{"nexus": {"prompt_window": 5000}}'],
     "nexus.prompt_window 5000"),
    (["--kv-budget", "256", "--additional-config", '{"nexus": {"interval": 5000}}'],
     "nexus.interval 5000"),
    (["--kv-budget", "256", "--additional-config", '{"nexus": {"skip_layers": 4}}'],
     "nexus.skip_layers 4"),  # the tiny model has 4 layers
    (["--kv-budget", "256", "--additional-config", '{"nexus": 0}'], "--additional-config"),
    (["--kv-budget", "256", "--additional-config", '{"nexus": {"lam": NaN}}'], "lam"),
    (["--kv-budget", "256", "--additional-config", '{"nexus": {"widow": 3}}'],
     "did you mean 'window' for 'widow'?"),
    (["--kv-budget", "1024", "--kv-prompt-mode", "end", "--kv-prefill-budget", "512"],
     "--kv-prefill-budget: prefill_budget must be at least the budget (1024 tokens)"),
    (["--kv-budget", "1024", "--kv-prompt-mode", "stream", "--kv-prefill-budget", "2048"],
     "--kv-prefill-budget: prefill_budget applies to prompt_mode 'end' only"),
    # A per-head score only, and the server pages blocks.
    (["--kv-eviction", "reconstruction", "--kv-budget", "256"],
     "--kv-eviction: policy 'reconstruction' scores (layer, KV head, token) units only"),
]


@pytest.fixture(scope="module")
def serve_parser():  # noqa: ANN201
    try:  # vLLM 0.32 keeps the serve parser here; 0.34 moved it to entrypoints.common
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ModuleNotFoundError:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import nexus_vllm

    nexus_vllm.register()
    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


@pytest.fixture
def vllm_process_state(monkeypatch):  # noqa: ANN001, ANN201
    """Restore the process-wide state ``create_engine_config`` touches: the global RNGs
    (vLLM seeds them)."""
    import random

    import numpy as np
    import torch

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


@pytest.fixture
def engine_build(serve_parser, tiny_model, vllm_process_state):  # noqa: ANN001, ANN201
    """``vllm serve`` argv -> ``create_engine_config()`` on the tiny model."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    def build(argv: list[str]) -> object:
        args = serve_parser.parse_args(["--model", tiny_model, *BASE_ARGV, *argv])
        return AsyncEngineArgs.from_cli_args(args).create_engine_config()

    return build


@needs_vllm
@pytest.mark.parametrize("argv, named", BUILD_CASES, ids=[c[1][:40] for c in BUILD_CASES])
def test_startup_refused_after_model_config(engine_build, argv, named) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as err:
        engine_build(argv)
    msg = str(err.value)
    assert msg.startswith("vllm serve: error: ") and "\n" not in msg, msg
    assert named in msg, msg


@needs_vllm
@pytest.mark.parametrize("argv", [["--kv-budget", str(MAX_LEN)], ["--kv-keep-ratio", "0.25"],
                                  ["--kv-budget", "384", "--block-size", "64"],
                                  # A prefill budget above --max-model-len never binds.
                                  ["--kv-budget", "256", "--kv-prompt-mode", "end",
                                   "--kv-prefill-budget", str(10 * MAX_LEN)]])
def test_startup_accepts_limits(engine_build, argv) -> None:  # noqa: ANN001
    cfg = engine_build(argv)
    assert cfg.additional_config["nexus"]["method"] == "nexus"


@needs_vllm
def test_python_api_gets_value_error(tiny_model, vllm_process_state) -> None:  # noqa: ANN001
    """Outside the CLI the same refusal is a ValueError naming the flag."""
    from vllm.engine.arg_utils import EngineArgs

    import nexus_vllm

    nexus_vllm.register()
    ea = EngineArgs(model=tiny_model, max_model_len=MAX_LEN,
                    additional_config={"nexus": {"method": "nexus", "max_tokens": 5000}})
    with pytest.raises(ValueError, match="--kv-budget 5000 is above --max-model-len 4096"):
        ea.create_engine_config()


# -- the two request hooks, without a server --------------------------------------------
def _fake_input_processor(nexus: dict | None) -> types.SimpleNamespace:
    return types.SimpleNamespace(vllm_config=types.SimpleNamespace(
        model_config=types.SimpleNamespace(max_model_len=MAX_LEN),
        additional_config={"nexus": nexus} if nexus else {}))


@needs_vllm
def test_serving_hook_returns_400_error_response() -> None:
    from vllm.entrypoints.serve.engine.serving import BaseServing

    from nexus_vllm.integration.frontend.patches.openai_serving import check_xargs

    serving = types.SimpleNamespace(
        input_processor=_fake_input_processor(_server_cfg().to_dict()),
        create_error_response=BaseServing.create_error_response)
    err = check_xargs(serving, types.SimpleNamespace(vllm_xargs={"kv_budjet": 256}))
    assert err is not None and err.error.code == 400
    assert err.error.param == "vllm_xargs.kv_budjet" and "kv_budget" in err.error.message
    err = check_xargs(serving, types.SimpleNamespace(vllm_xargs={"kv_budget": MAX_LEN * 2}))
    assert err is not None and err.error.param == "vllm_xargs.kv_budget"
    assert check_xargs(serving, types.SimpleNamespace(vllm_xargs={"kv_budget": 512})) is None
    assert check_xargs(serving, types.SimpleNamespace(vllm_xargs=None)) is None


@needs_vllm
def test_engine_side_backstop() -> None:
    """``InputProcessor._validate_params`` (every way into the engine) refuses the same
    fields with a ``VLLMValidationError`` naming them, after vLLM's own checks."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    from nexus_vllm.integration.frontend.patches.input_processor import _wrap

    validate = _wrap(lambda self, params, *args: "vllm-checked")
    on, off = _fake_input_processor(_server_cfg().to_dict()), _fake_input_processor(None)
    for processor, xargs, field in ((on, {"kv_budget": MAX_LEN + 1}, "kv_budget"),
                                    (on, {"kv_evict": "h2o"}, "kv_evict"),
                                    (off, {"kv_budget": 512}, "kv_budget")):
        with pytest.raises(VLLMValidationError) as err:
            validate(processor, SamplingParams(extra_args=xargs), ("generate",))
        assert err.value.parameter == f"vllm_xargs.{field}"
    # vLLM's own extra_args key (set from the request's kv_transfer_params) passes.
    params = SamplingParams(extra_args={"kv_transfer_params": {}, "kv_budget": 512})
    assert validate(on, params, ("generate",)) == "vllm-checked"


@needs_vllm
def test_serving_hook_targets() -> None:
    """Canary for the vLLM internals the request hook relies on (vLLM 0.32)."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    import nexus_vllm

    nexus_vllm.register()
    for cls, render, create in (
            (OpenAIServingCompletion, "render_completion_request", "_create_completion"),
            (OpenAIServingChat, "render_chat_request", "_create_chat_completion"),
            (OpenAIServingResponses, "_render_resolved_response_inputs",
             "_create_responses")):
        hook = getattr(cls, render)
        assert hook._nexus_patched and inspect.iscoroutinefunction(hook)
        assert list(inspect.signature(hook.__wrapped__).parameters)[:2] == ["self", "request"]
        # Rendered (so checked) before the stream generator is handed to the router.
        src = inspect.getsource(getattr(cls, create))
        assert src.index(f"self.{render}(") < src.index("if request.stream:")
    # /v1/responses carries vllm_xargs into SamplingParams.extra_args, as the others do.
    params = ResponsesRequest(input="hi", vllm_xargs={"kv_budget": 512}).to_sampling_params(
        16, {})
    assert params.extra_args == {"kv_budget": 512}
    # The serving object reaches the engine's config through its input processor.
    src = inspect.getsource(GenerateBaseServing.__init__)
    assert "self.input_processor = engine_client.input_processor" in src


# -- one evicting server, fuzzed over HTTP ----------------------------------------------
# (raw JSON of vllm_xargs, field, part of the message; "" = pydantic's own 400)
HTTP_CASES = [
    ('{"kv_budget": -5}', "kv_budget", POSITIVE),
    ('{"kv_budget": 0}', "kv_budget", POSITIVE),
    ('{"kv_budget": "256"}', "kv_budget", "(a string)"),
    ('{"kv_budget": 256.5}', "kv_budget", POSITIVE),
    ('{"kv_budget": NaN}', "kv_budget", "got nan"),
    ('{"kv_budget": Infinity}', "kv_budget", "got inf"),
    ('{"kv_budget": 1e400}', "kv_budget", "got inf"),  # overflows to inf when parsed
    ('{"kv_budget": [256]}', "kv_budget", "(a list)"),
    ('{"kv_budget": true}', "kv_budget", f"at least {FLOOR}"),  # pydantic makes it 1
    ('{"kv_budget": null}', "kv_budget", ""),
    ('{"kv_budget": 32}', "kv_budget", f"at least {FLOOR}"),
    ('{"kv_budget": 100000}', "kv_budget", "max model length"),
    ('{"kv_eviction": "lru"}', "kv_eviction", ONE_OF),
    ('{"kv_eviction": 7}', "kv_eviction", ONE_OF),
    ('{"kv_budjet": 256}', "kv_budjet", "did you mean 'kv_budget'?"),
    ('{"kv_keep_ratio": 0.5}', "kv_keep_ratio", "--kv-keep-ratio"),
    ('{"kv_prompt_mode": "begin"}', "kv_prompt_mode", "must be one of stream, end, keep"),
    ('{"kv_prefill_budget": 1024}', "kv_prefill_budget", "'end' only"),
    ('{"kv_prompt_mode": "end", "kv_prefill_budget": 100}', "kv_prefill_budget",
     "at least the budget"),
]
# Each endpoint's body (besides model, stream and vllm_xargs), asking for 4 tokens.
ENDPOINTS = {
    "/v1/completions": {"prompt": "hello there", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello there"}],
                             "max_tokens": 4},
    # No store: the server runs without VLLM_ENABLE_RESPONSES_API_STORE.
    "/v1/responses": {"input": "hello there", "max_output_tokens": 4, "store": False},
}


@pytest.fixture(scope="module")
def server(tiny_model, serve_tmp):  # noqa: ANN001, ANN201
    from nexus_vllm.eval.server import VllmServer

    # A streaming server, as _server_cfg: the prompt-mode cases are refused against it.
    srv = VllmServer(tiny_model, ["--kv-eviction", "nexus", "--kv-budget", "256",
                                  "--kv-chunk-size", "128", "--kv-prompt-mode", "stream"],
                     serve_tmp)
    srv.ready_at = srv.log_path.stat().st_size  # only what follows startup is checked
    yield srv
    srv.stop()


def _error_lines(log: str) -> list[str]:
    """Lines logged at ERROR (vLLM's ``... ERROR ...`` and uvicorn's ``ERROR:``) and
    traceback headers."""
    return [line for line in log.splitlines()
            if re.search(r"(^|\s)ERROR[\s:]", line) or "Traceback" in line]


def _post(server, endpoint: str, stream: bool, xargs_json: str):  # noqa: ANN001, ANN202
    import requests

    # Raw JSON: NaN, Infinity and wrong types go out exactly as written.
    body = json.dumps({"model": server.model, "stream": stream, **ENDPOINTS[endpoint]})
    body = body[:-1] + f', "vllm_xargs": {xargs_json}}}'
    return requests.post(server.base_url + endpoint, data=body, stream=stream, timeout=120,
                         headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@pytest.mark.parametrize("xargs, field, allowed", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
@pytest.mark.e2e
@pytest.mark.slow
@needs_vllm
def test_bad_xargs_are_400_before_any_stream(server, endpoint, stream, xargs, field,
                                            allowed) -> None:  # noqa: ANN001
    with _post(server, endpoint, stream, xargs) as r:
        assert r.status_code == 400, r.text[:500]
        assert r.headers["content-type"].startswith("application/json")  # no event stream
        error = r.json()["error"]
    assert error["code"] == 400 and f"vllm_xargs.{field}" in error["message"], error
    if allowed:  # ours (not pydantic's): the field is the error's param too
        assert error["param"] == f"vllm_xargs.{field}" and allowed in error["message"], error


@pytest.mark.e2e
@pytest.mark.slow
@needs_vllm
def test_server_keeps_serving_and_logs_no_error(server) -> None:  # noqa: ANN001
    for stream in (False, True):
        with _post(server, "/v1/chat/completions", stream, '{"kv_budjet": 1}') as r:
            assert r.status_code == 400
    with _post(server, "/v1/completions", False,
               '{"kv_budget": 4096, "session_id": "s", "my_plugin_knob": 1}') as r:
        assert r.status_code == 200, r.text[:500]
        assert r.json()["usage"]["completion_tokens"] == 4
    with _post(server, "/v1/chat/completions", True, '{"kv_eviction": "none"}') as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream")
        events = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), events
    # /v1/responses: refused, then served, streamed and not.
    for stream in (False, True):
        with _post(server, "/v1/responses", stream, '{"kv_budget": -5}') as r:
            assert r.status_code == 400
    with _post(server, "/v1/responses", False, '{"kv_budget": 512}') as r:
        assert r.status_code == 200, r.text[:500]
        assert r.json()["status"] in ("completed", "incomplete"), r.text[:500]
    with _post(server, "/v1/responses", True, '{"kv_budget": 512}') as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream")
        events = [line for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("event: ")]
    assert events[-1] in ("event: response.completed", "event: response.incomplete"), events
    assert not any("error" in e for e in events), events
    log = pathlib.Path(server.log_path).read_text(errors="replace")[server.ready_at:]
    bad = _error_lines(log)
    assert not bad, "\n".join(bad[:20])
    assert "400 Bad Request" in log  # the requests above did reach this log


# -- a few real `vllm serve` startups ---------------------------------------------------
STARTUP_CASES = [
    (["--kv-eviction", "nexus", "--kv-budget", "nan"], "argument --kv-budget"),
    (["--kv-eviction", "nexus", "--kv-budget", "5000", "--max-model-len", "4096"],
     "--kv-budget 5000 is above --max-model-len 4096"),
    (["--kv-eviction", "nexus", "--kv-budget", "1024", "--kv-eviction-config", "{preset}"],
     "--kv-eviction-config: unknown eviction config key(s) ['wnidow']"),
    (["--kv-eviction", "nexus", "--kv-budget", "1024", "--kv-prompt-mode", "end",
      "--kv-prefill-budget", "512"],
     "--kv-prefill-budget: prefill_budget must be at least the budget (1024 tokens)"),
]


@pytest.mark.parametrize("argv, named", STARTUP_CASES,
                         ids=["nan", "above-max-len", "key", "prefill-budget"])
@pytest.mark.e2e
@pytest.mark.slow
@needs_vllm
def test_vllm_serve_stops_with_one_clean_line(tiny_model, serve_tmp, tmp_path, argv,
                                              named) -> None:  # noqa: ANN001
    from nexus_vllm.eval.server import server_env, vllm_cmd

    preset = tmp_path / "preset.yaml"
    preset.write_text("nexus:\n  method: nexus\n  wnidow: 8\n")
    argv = [a.replace("{preset}", str(preset)) for a in argv]
    out = subprocess.run(vllm_cmd(tiny_model, "--port", "1", *argv), capture_output=True,
                         text=True, timeout=180, env=server_env(serve_tmp))
    text = out.stderr + out.stdout
    assert out.returncode != 0, text[-3000:]
    assert not _error_lines(text), text[-3000:]
    errors = [line for line in text.splitlines() if "error:" in line]
    assert len(errors) == 1 and named in errors[0], text[-3000:]
