"""The server's eviction config: ``--kv-*`` flags, ``--kv-eviction-config`` files and
``--additional-config``, layered into one :class:`nexus_vllm.core.EvictionConfig`.

Layering (later wins): ``EvictionConfig`` defaults < ``--kv-eviction-config FILE|NAME`` <
``--additional-config '{"nexus": {...}}'`` < the ``--kv-*`` flags. The resolved config is
stored back into ``additional_config["nexus"]`` as a plain dict so every vLLM process
(API server, engine core, workers) rebuilds the same frozen object from the VllmConfig.
Every process decodes it with ``integration/config.py``; per-request ``vllm_xargs`` are
checked against it in :mod:`.request_args`; what the engine must look like around it is
:mod:`.engine_policy`.

This module imports no vLLM code: it is unit-testable on its own.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeVar

from nexus_vllm.argtypes import float_in, int_at_least
from nexus_vllm.core.config import PROMPT_MODES, EvictionConfig
from nexus_vllm.core.policies import METHODS
from nexus_vllm.integration.config import ADDITIONAL_CONFIG_KEY

if TYPE_CHECKING:
    from importlib.abc import Traversable

__all__ = [
    "CLI_FLAGS",
    "METHODS",
    "SERVER_FLAGS",
    "add_cli_flags",
    "additional_config_from_cli",
    "load_config_file",
    "resolve_config",
]

# CLI flag -> EvictionConfig field.
CLI_FLAGS = {
    "--kv-eviction": "method",
    "--kv-budget": "max_tokens",
    "--kv-keep-ratio": "keep_ratio",
    "--kv-eviction-seed": "seed",
    "--kv-chunk-size": "chunk_size",
    "--kv-prompt-mode": "prompt_mode",
    "--kv-prefill-budget": "prefill_budget",
}
SERVER_FLAGS = (*CLI_FLAGS, "--kv-eviction-config")
# EvictionConfig field -> the flag that sets it: ours, and vLLM's --block-size (it sets
# the block size, hence the budget floor). A bad field may come from a file while a flag
# made it bad (--kv-prompt-mode keep against a file's prefill_budget, --block-size raising
# the floor under a file's max_tokens): the error names the flag of a field its rule read
# (ConfigError.reads).
_FLAG_OF_FIELD = {**{field: flag for flag, field in CLI_FLAGS.items()},
                  "block_size": "--block-size"}


# -- the --kv-* flags ----------------------------------------------------------------------
_positive_int = int_at_least(1, "a positive integer")
_non_negative_int = int_at_least(0)
_ratio = float_in(0, 1)


_Parser = TypeVar("_Parser", bound=argparse.ArgumentParser)


def add_cli_flags(parser: _Parser) -> _Parser:
    """Add the ``--kv-*`` flags to ``parser`` (no-op when already there); argparse checks
    each value on its own and names the flag on error."""
    if "--kv-eviction" in getattr(parser, "_option_string_actions", {}):
        return parser
    group = parser.add_argument_group(
        title="Nexus KV eviction (nexus-vllm plugin)",
        description="Streaming KV-cache eviction under a per-request token budget.",
    )
    group.add_argument("--kv-eviction", choices=METHODS, default=None,
                       help="Eviction method; 'none' (default) leaves vLLM unchanged.")
    group.add_argument("--kv-budget", type=_positive_int, default=None, metavar="TOKENS",
                       help="KV budget per request, in tokens.")
    group.add_argument("--kv-keep-ratio", type=_ratio, default=None, metavar="R",
                       help="KV budget as a fraction of the tokens seen (instead of "
                            "--kv-budget).")
    group.add_argument("--kv-eviction-config", type=str, default=None, metavar="FILE|NAME",
                       help="YAML/JSON file of eviction knobs, or a shipped preset's name "
                            "(e.g. nexus-fast; `nexus-vllm presets` lists them).")
    group.add_argument("--kv-eviction-seed", type=_non_negative_int, default=None,
                       help="Seed of the block sampler (per request: mixed with the "
                            "request's seed).")
    group.add_argument("--kv-chunk-size", type=_positive_int, default=None, metavar="TOKENS",
                       help="Prefill chunk where events fire mid-prompt (prompt mode "
                            "stream, or end under --kv-prefill-budget; default 512): such a "
                            "request never holds more than budget + one chunk.")
    group.add_argument("--kv-prompt-mode", choices=PROMPT_MODES, default=None,
                       help="When the budget holds: 'end' (default) keeps the prompt "
                            "(up to --kv-prefill-budget) until its last chunk, then one "
                            "event, with the question in its window, evicts to the budget; "
                            "'stream' from the first prompt chunk, an event after each; "
                            "'keep' never evicts the prompt (the budget counts generated "
                            "tokens). Per request: vllm_xargs kv_prompt_mode.")
    group.add_argument("--kv-prefill-budget", type=_positive_int, default=None,
                       metavar="TOKENS",
                       help="With --kv-prompt-mode end: tokens a request may keep while its "
                            "prompt is computed (default: the whole prompt); at least the "
                            "budget. Per request: vllm_xargs kv_prefill_budget.")
    return parser


def additional_config_from_cli(args: argparse.Namespace,
                               additional_config: Mapping[str, object] | None,
                               block_size: int | None) -> dict[str, object] | None:
    """vLLM's ``additional_config`` with the server's resolved config under ``nexus``.

    Parameters
    ----------
    args : argparse.Namespace
        The parsed ``vllm serve`` command line (the ``--kv-*`` flags).
    additional_config : dict, optional
        ``--additional-config`` as vLLM parsed it.
    block_size : int, optional
        vLLM's ``--block-size`` (it sets the budget floor, so the budget is checked
        against it here, where the error can name both flags).

    Returns
    -------
    dict or None
        None when no source asks for eviction (vLLM's arguments stay as they are).

    Raises
    ------
    ValueError
        Naming the flag or source that holds the bad value.
    """
    flags: dict[str, object] = {field: getattr(args, flag[2:].replace("-", "_"), None)
                             for flag, field in CLI_FLAGS.items()}
    file = getattr(args, "kv_eviction_config", None)
    additional = dict(additional_config or {})
    nexus = additional.get(ADDITIONAL_CONFIG_KEY)
    # ``nexus`` of 0, "" or [] is an error (resolve_config), not a silent "off".
    if not file and nexus in (None, {}) and all(v is None for v in flags.values()):
        return None
    if block_size is not None:
        flags["block_size"] = block_size
    cfg = resolve_config(file=file, additional=nexus, flags=flags)
    if cfg.method == "none" and not nexus:
        return None
    additional[ADDITIONAL_CONFIG_KEY] = cfg.to_dict()
    return additional


# -- files, --additional-config, and the layering ----------------------------------------
def load_config_file(path: str | pathlib.Path) -> dict[str, object]:
    """Read a YAML or JSON eviction preset: a file, or a shipped preset by name.

    The file holds either the knobs at top level or under a ``nexus:`` key. An existing
    file wins; else a bare name (``nexus-fast`` or ``nexus-fast.yaml``) is looked up among
    the shipped presets (``nexus_vllm.presets``, ``nexus-vllm presets``).

    Raises
    ------
    ValueError
        Naming ``--kv-eviction-config`` when the file is missing (listing the presets when
        a name was given), unparsable or not a mapping.
    """
    from nexus_vllm import presets

    p = pathlib.Path(path)
    source: pathlib.Path | Traversable = p
    if not p.is_file():
        preset = presets.find(str(path))
        if preset is None:
            if presets.is_name(str(path)):
                raise ValueError(presets.unknown_message(str(path)))
            raise ValueError(f"--kv-eviction-config: no such file {str(p)!r}")
        source = preset
    text = source.read_text()
    try:
        if source.name.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # yaml and json raise different types
        raise ValueError(f"--kv-eviction-config: cannot parse {str(source)!r}: {exc}") from exc
    if data is None:
        data = {}
    if isinstance(data, dict) and ADDITIONAL_CONFIG_KEY in data:
        data = data[ADDITIONAL_CONFIG_KEY]
    if not isinstance(data, dict):
        raise ValueError(f"--kv-eviction-config: {str(source)!r} must hold a mapping of knobs")
    return dict(data)


def _blamed_flag(field: str, reads: tuple[str, ...], given: Mapping[str, object]
                 ) -> str | None:
    """The given flag a bad ``field`` (a ``ConfigError.field``) is blamed on: its own
    flag, else the flag of a field its rule read (``ConfigError.reads``; None when no flag
    is involved)."""
    for key in (field, *reads):
        if key in given and key in _FLAG_OF_FIELD:
            return _FLAG_OF_FIELD[key]
    return None


def _build(knobs: Mapping[str, object], source: str,
           given: Mapping[str, object] | None = None) -> EvictionConfig:
    """``EvictionConfig`` from ``knobs``; an error names the flag it is about (from
    ``ConfigError.field``), else ``source``."""
    try:
        return EvictionConfig.from_dict(knobs)
    except (TypeError, ValueError) as exc:
        field = getattr(exc, "field", None)
        flag = (_blamed_flag(field, tuple(getattr(exc, "reads", ())), given or {})
                if isinstance(field, str) else None)
        raise ValueError(f"{flag or source}: {exc}") from exc


def resolve_config(
    *,
    file: str | None = None,
    additional: object = None,
    flags: Mapping[str, object] | None = None,
) -> EvictionConfig:
    """Merge the three sources into one validated ``EvictionConfig``.

    Parameters
    ----------
    file : str, optional
        ``--kv-eviction-config`` path, or a shipped preset's name.
    additional : dict, optional
        ``additional_config["nexus"]``.
    flags : dict, optional
        ``EvictionConfig`` field -> value from the ``--kv-*`` flags and vLLM's
        ``--block-size`` (None = not given).

    Raises
    ------
    ValueError
        Naming the flag or source that holds the bad value.
    """
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    # Each layer is checked on its own so an error names it; a policy's knobs are checked
    # against the method that will run (the flag's, when given).
    method = {"method": given["method"]} if "method" in given else {}
    knobs: dict[str, object] = {}
    if file:
        knobs.update(load_config_file(file))
        _build({**knobs, **method}, "--kv-eviction-config")
    if additional is not None:
        if not isinstance(additional, dict):
            raise ValueError("--additional-config: 'nexus' must be a JSON object of "
                             f"eviction knobs; got {additional!r}")
        knobs.update(additional)
        _build({**knobs, **method}, "--additional-config nexus")
    # A budget flag replaces the other budget form coming from a file/additional config.
    if "max_tokens" in given:
        knobs.pop("keep_ratio", None)
    if "keep_ratio" in given:
        knobs.pop("max_tokens", None)
    knobs.update(given)
    cfg = _build(knobs, "flags", given)
    if cfg.method != "none" and cfg.max_tokens is None and cfg.keep_ratio is None:
        raise ValueError(
            f"--kv-eviction {cfg.method} needs a budget: pass --kv-budget TOKENS "
            "or --kv-keep-ratio R"
        )
    return cfg
