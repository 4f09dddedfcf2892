"""``nexus-vllm size``'s flags: each checked on its own by argparse, then together
(:func:`sizing_from_args`), each error naming its flag."""

from __future__ import annotations

import argparse
import json
import sys
from typing import cast

from nexus_vllm.argtypes import float_in, int_at_least
from nexus_vllm.core import ConfigError, EvictionConfig
from nexus_vllm.core.config import PROMPT_MODES
from nexus_vllm.eval.budget import parse_budget

from .burst import split_context
from .groups import eviction_refusal
from .memory import GIB
from .report import HYBRID_STEP_TOKENS, Sizing, SizingInputs, format_sizing, size_replica
from .shape import BUILTIN_MODELS, model_shape

__all__ = ["build_parser", "main", "sizing_from_args"]


def _budget(text: str) -> float | int:
    try:
        return parse_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nexus-vllm size",
        description="KV blocks per GPU and concurrent requests with and without eviction, "
                    "from the server's own admission rules (no vLLM needed).")
    p.add_argument("--model", required=True,
                   help=f"built-in ({', '.join(BUILTIN_MODELS)}) or an HF config.json (or "
                        "its directory)")
    p.add_argument("--gpu-memory-gib", type=float_in(0), default=None,
                   help="memory of one GPU, GiB (or give --pool-blocks)")
    p.add_argument("--gpu-util", type=float_in(0, 1), default=0.9,
                   help="vLLM's --gpu-memory-utilization (default 0.9)")
    p.add_argument("--overhead-gib", type=float_in(0, low_open=False), default=4.0,
                   help="per GPU, for activations, CUDA graphs and non-torch memory, which "
                        "vLLM profiles at start-up (default 4)")
    p.add_argument("--tp", type=int_at_least(1), default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int_at_least(1), default=1, help="pipeline parallel size")
    p.add_argument("--block-size", type=int_at_least(1), default=16,
                   help="tokens per KV block (default 16, vLLM's on GPU)")
    p.add_argument("--pool-blocks", type=int_at_least(2), default=None,
                   help="vLLM's --num-gpu-blocks-override: skip the memory arithmetic")
    p.add_argument("--context", type=int_at_least(1), required=True,
                   help="--max-model-len, tokens")
    p.add_argument("--prompt-tokens", type=int_at_least(1), default=None,
                   help="prompt per request (default: with --output-tokens, the context "
                        "less one block, split 64:1 as the capacity benchmark does)")
    p.add_argument("--output-tokens", type=int_at_least(1), default=None,
                   help="output per request (default: see --prompt-tokens)")
    p.add_argument("--budget", type=_budget, required=True,
                   help="a keep ratio in (0, 1] like 0.2, or tokens like 4096")
    p.add_argument("--method", default="nexus", help="eviction policy (default nexus)")
    default_mode = EvictionConfig.prompt_mode  # the server's default
    p.add_argument("--prompt-mode", choices=PROMPT_MODES, default=default_mode,
                   help=f"when the budget holds (default {default_mode}, as the server's)")
    p.add_argument("--prefill-budget", type=int_at_least(1), default=None,
                   help="prompt_mode end: tokens kept while the prompt is computed")
    p.add_argument("--chunk-size", type=int_at_least(1), default=512,
                   help="prefill chunk of evicting requests, tokens (default 512)")
    p.add_argument("--max-num-seqs", type=int_at_least(1), default=1024,
                   help="vLLM's cap on running requests (default 1024, vLLM 0.32's on "
                        "H100/H200); the burst has this many requests")
    p.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=None,
                   help="vLLM's token budget per step (default: none, so the KV pool "
                        "alone sets the concurrency; vLLM's on H100/H200 is 8192, and with "
                        "short answers prefill throughput can bind before the pool; a model "
                        "with sliding-window layers takes "
                        f"{HYBRID_STEP_TOKENS}, as its sliding groups hold the steps in "
                        "flight beyond their window while a prompt is computed)")
    p.add_argument("--steps-in-flight", type=int_at_least(1), default=None,
                   help="steps vLLM schedules before the first one's output is back (its "
                        "max_concurrent_batches; default pp + 1, vLLM 0.32's on GPU with "
                        "async scheduling): each sliding-window group holds their tokens "
                        "beyond its window, whole steps while a prompt is computed and one "
                        "token each once it decodes")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def sizing_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Sizing:
    """Validate the flags (each error names its flag) and size the replica."""
    try:
        model = model_shape(args.model)
    except ConfigError as exc:
        parser.error(f"--model: {exc}")
    refusal = eviction_refusal(model)
    if refusal is not None:
        parser.error(f"--model: {refusal}")
    if model.attention_heads % args.tp:
        parser.error(f"--tp {args.tp}: must divide the {model.attention_heads} attention "
                     "heads (vLLM's rule)")
    if args.pool_blocks is None and args.gpu_memory_gib is None:
        parser.error("--gpu-memory-gib: required unless --pool-blocks is given")
    if (args.prompt_tokens is None) != (args.output_tokens is None):
        parser.error("--prompt-tokens and --output-tokens: give both or neither")
    if args.prompt_tokens is None:
        if args.context <= args.block_size + 1:
            parser.error(f"--context {args.context}: must exceed one block "
                         f"({args.block_size}) plus a token")
        prompt, output = split_context(args.context, args.block_size)
    else:
        prompt, output = args.prompt_tokens, args.output_tokens
        if prompt + output > args.context:
            parser.error(f"--context {args.context}: shorter than --prompt-tokens + "
                         f"--output-tokens = {prompt + output}")
    try:
        cfg = EvictionConfig.from_budget(
            args.method, args.budget, prompt_mode=args.prompt_mode,
            prefill_budget=args.prefill_budget, chunk_size=args.chunk_size,
            block_size=args.block_size)
    except ConfigError as exc:
        flag = {"method": "--method", "max_tokens": "--budget", "keep_ratio": "--budget",
                "budget": "--budget"}.get(exc.field, f"--{exc.field.replace('_', '-')}")
        parser.error(f"{flag}: {exc}")
    if cfg.method == "none":
        parser.error("--method: 'none' does not evict; the stock column is that sizing")
    # Every flag but --json, as argparse parsed it (its namespace is untyped).
    inputs = cast(SizingInputs, {k: v for k, v in vars(args).items() if k != "json"})
    try:
        return size_replica(model, cfg, pool_blocks=args.pool_blocks,
                         gpu_memory_gib=args.gpu_memory_gib, gpu_util=args.gpu_util,
                         overhead_gib=args.overhead_gib, tp=args.tp, pp=args.pp,
                         context=args.context, prompt_tokens=prompt, output_tokens=output,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, inputs=inputs,
                         steps_in_flight=args.steps_in_flight)
    except ConfigError as exc:
        parser.error(f"--{exc.field.replace('_', '-')}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sizing = sizing_from_args(args, parser)
    if sizing.memory is not None and sizing.pool_blocks < 2:
        left = sizing.memory["kv_bytes_per_gpu"] / GIB
        print(f"nexus-vllm size: no memory left for KV: {left:.2f} GiB per GPU after the "
              "weights and the overhead", file=sys.stderr)
        return 1
    print(json.dumps(sizing.to_dict(), indent=2) if args.json else format_sizing(sizing))
    return 0

