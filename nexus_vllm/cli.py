"""``nexus-vllm`` command line: a thin dispatcher to each part's own ``main(argv)``.

Subcommands import lazily so that ``nexus-vllm simulate`` never pays for vLLM or
transformers imports.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("nexus_vllm.sim.cli", "streaming eviction on synthetic block weights"),
    "eval": ("nexus_vllm.eval.cli", "quality per policy and budget on a real model"),
    "records": ("nexus_vllm.eval.records", "merge and filter eval records.jsonl files"),
    "compare": ("nexus_vllm.eval.compare", "one method vs others on the same samples, paired"),
    "sweep": ("nexus_vllm.eval.sweep",
              "budget sweeps side by side: the smallest budget keeping a share of dense"),
    "survival": ("nexus_vllm.eval.survival",
                 "block survival across events on a real model: topk vs pps vs ares"),
    "parity": ("nexus_vllm.eval.server_parity",
               "a running server vs. the transformers path, token for token"),
    "server-eval": ("nexus_vllm.eval.server_eval",
                    "the chat-shaped suite through a running server's chat API"),
    "prepare-model": ("nexus_vllm.models",
                      "build an embedded model's checkpoint (--model NAME, --list)"),
    "serve": ("nexus_vllm.integration.frontend.serve", "vllm serve with Nexus eviction on"),
    "presets": ("nexus_vllm.presets", "list the --kv-eviction-config presets (--show NAME)"),
    "size": ("nexus_vllm.sizing", "KV blocks per GPU, concurrent requests with/without eviction"),
}
# Old command names still accepted, each with a one-line notice on stderr.
RENAMED: dict[str, str] = {"plan": "size"}


def _usage() -> str:
    lines = ["usage: nexus-vllm <command> [options]", "", "commands:"]
    lines += [f"  {name:<14} {about}" for name, (_, about) in SUBCOMMANDS.items()]
    lines.append("\n`nexus-vllm <command> --help` shows a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = args[0], args[1:]
    if command in RENAMED:
        print(f"nexus-vllm: `{command}` is now `{RENAMED[command]}`; the old name will go in a "
              "later release", file=sys.stderr)
        command = RENAMED[command]
    if command not in SUBCOMMANDS:
        print(f"nexus-vllm: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
