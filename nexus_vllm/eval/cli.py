"""``nexus-vllm eval``: offline long-context evaluation of eviction policies.

Example (the headline run)::

    nexus-vllm eval --tasks niah_single_noise,niah_single_prose --methods dense,nexus,h2o \\
        --budgets 0.2 --context 2048 --samples 4 --seeds 2 --out runs/headline

Writes into ``--out``: ``records.jsonl`` (one line per run, resumable), ``results.json``
(config + aggregated rows with 95% bootstrap intervals), ``config.yaml``, ``table.md`` and
``plot_<metric>.png`` (metric vs budget per task).

``--calibrate`` runs dense only over the tasks and ``--context`` lengths (comma list) and
writes ``calibration.md``: keep tasks and lengths where dense is well above chance.
``--report-only`` rebuilds the reports from the records on disk; ``--publish DIR`` then
copies the run's reports and records into DIR (``docs/figures/<run>``).
``--peer kvpress`` adds kvpress's presses on the same samples (``--peer-presses`` picks
some: :mod:`nexus_vllm.eval.peers`), written to ``kvpress_records.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nexus_vllm.eval.budget import parse_budget

if TYPE_CHECKING:
    from nexus_vllm.eval.runner import RunConfig

__all__ = ["build_parser", "default_methods", "main", "run_config"]

DEFAULT_TASKS = "niah_single_noise,niah_single_prose,niah_multikey,vt,passkey"


def default_methods() -> str:
    """``dense`` and every registered policy (``nexus_vllm.core.POLICIES``), comma-separated:
    a policy registered from any module joins the default run."""
    from nexus_vllm.core.policies import POLICIES

    return ",".join(("dense", *POLICIES))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nexus-vllm eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=pathlib.Path, default=None,
                   help="YAML file with any of these options (CLI flags override it)")
    p.add_argument("--model", default=None,
                   help="HF model dir or hub name (default: the embedded SmolLM2-135M)")
    p.add_argument("--tasks", default=None, help=f"comma list (default {DEFAULT_TASKS})")
    p.add_argument("--methods", default=None,
                   help="comma list (default: dense and every registered policy); a method "
                        "may carry knobs: 'nexus:sampler=topk,lam=0' (separate specs with "
                        "';' when knobs are used)")
    p.add_argument("--budgets", default=None, help="comma list; float = kept ratio, int = tokens")
    p.add_argument("--context", default=None, help="target prompt tokens (comma list allowed)")
    p.add_argument("--samples", type=int, default=None, help="samples per task")
    p.add_argument("--seeds", type=int, default=None,
                   help="sampler seeds per sample for stochastic methods")
    p.add_argument("--data-seed", type=int, default=None,
                   help="sample set (tune knobs on one, report on another; default 1)")
    p.add_argument("--protocol", default=None, help="question-last,question-first")
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--knobs", default=None,
                   help="JSON dict of EvictionConfig knobs for every eviction method")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    p.add_argument("--calibrate", action="store_true", help="dense only; write calibration.md")
    p.add_argument("--peer", choices=["kvpress"], default=None,
                   help="also run the reference library's presses (own virtualenv)")
    p.add_argument("--peer-presses", default=None,
                   help="comma list of kvpress presses for --peer kvpress (default: all; "
                        "see nexus_vllm.eval.peers.PEER_PRESSES)")
    p.add_argument("--out", type=pathlib.Path, required=False, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild results/table/plots from records.jsonl without running")
    p.add_argument("--publish", type=pathlib.Path, default=None, metavar="DIR",
                   help="afterwards copy the reports, records and config into DIR")
    return p


# A published run's config.yaml (``config_dict``) names these as the run holds them.
_PUBLISHED_NAMES = {"contexts": "context", "protocols": "protocol"}
# Written beside a run's options for the record, not options themselves.
_PROVENANCE = ("torch",)


def _merge(args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    if args.config is not None:
        import yaml

        cfg = yaml.safe_load(args.config.read_text()) or {}
        if not isinstance(cfg, dict):
            raise ValueError(f"--config {args.config} must hold a mapping")
        cfg = {_PUBLISHED_NAMES.get(k.replace("-", "_"), k.replace("-", "_")): v
               for k, v in cfg.items() if k not in _PROVENANCE}
        known = set(vars(args)) - {"config"}
        unknown = sorted(set(cfg) - known)
        if unknown:  # a typo must not pass silently (it would run the default instead)
            raise SystemExit(f"nexus-vllm eval: --config {args.config}: unknown key(s) "
                             f"{', '.join(unknown)}; known: {', '.join(sorted(known))}")
    for k, v in vars(args).items():
        if v is not None and k != "config" and v is not False:
            cfg[k] = v
    return cfg


def _as_list(v: object, sep: str = ",") -> list[str]:
    if isinstance(v, (list, tuple)):
        return [str(x) for x in v]
    return [t.strip() for t in str(v).split(sep) if t.strip()]


def _methods(v: object) -> list[str]:
    if isinstance(v, (list, tuple)):
        return [str(x) for x in v]
    text = str(v)
    # Knobs use commas ('nexus:sampler=topk,lam=0'), so specs with knobs are split on ';';
    # a list without knobs may use either separator.
    return _as_list(text, ";" if ":" in text or ";" in text else ",")


def run_config(opts: dict[str, Any]) -> RunConfig:
    """The validated ``RunConfig`` of merged options (a ``--config`` file and flags).

    Raises
    ------
    SystemExit
        Naming the bad task, budget, method or knob (no traceback for a user's typo).
    """
    from nexus_vllm.eval.dialogues import DIALOGUE_TASKS
    from nexus_vllm.eval.runner import RunConfig
    from nexus_vllm.eval.tasks import PROTOCOLS, TASKS

    threads = int(opts.get("threads", 1))

    tasks = _as_list(opts.get("tasks", DEFAULT_TASKS))
    for t in tasks:
        if t not in TASKS and t not in DIALOGUE_TASKS:
            raise SystemExit(f"unknown task {t!r}; choose from "
                             f"{sorted(TASKS) + list(DIALOGUE_TASKS)}")
    protocols = _as_list(opts.get("protocol", ",".join(PROTOCOLS)))
    methods = ["dense"] if opts.get("calibrate") else _methods(
        opts["methods"] if "methods" in opts else default_methods())
    knobs = opts.get("knobs") or {}
    if isinstance(knobs, str):
        knobs = json.loads(knobs)
    # YAML gives numbers (kept as typed), the command line a comma list of strings.
    raw = opts.get("budgets", "0.2")
    try:
        budgets = [parse_budget(b) for b in (raw if isinstance(raw, (list, tuple))
                                             else _as_list(raw))]
        cfg = RunConfig(
            model=str(opts.get("model") or "default"), tasks=tuple(tasks),
            methods=tuple(methods), budgets=tuple(budgets),
            contexts=tuple(int(c) for c in _as_list(opts.get("context", 2048))),
            protocols=tuple(protocols), samples=int(opts.get("samples", 4)),
            seeds=int(opts.get("seeds", 2)), data_seed=int(opts.get("data_seed", 1)),
            chunk_size=int(opts.get("chunk_size", 512)), knobs=dict(knobs), threads=threads,
        )
    except ValueError as exc:  # bad budgets, methods or knobs: say which, no traceback
        raise SystemExit(f"nexus-vllm eval: {exc}") from None
    return cfg


def _peer_presses(opts: Mapping[str, object]) -> list[str] | None:
    """The kvpress presses asked for (None: all), checked before anything runs.

    Raises
    ------
    SystemExit
        Naming the unknown presses and the choices, or a list without ``--peer kvpress``.
    """
    if opts.get("peer_presses") is None:
        return None
    if opts.get("peer") != "kvpress":
        raise SystemExit("nexus-vllm eval: --peer-presses needs --peer kvpress")
    from nexus_vllm.eval.peers import check_presses

    try:
        return check_presses(_as_list(opts["peer_presses"]))
    except ValueError as exc:
        raise SystemExit(f"nexus-vllm eval: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = _merge(args)
    out = pathlib.Path(opts.get("out") or "runs/eval")
    threads = int(opts.get("threads", 1))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    torch.set_num_threads(threads)
    from nexus_vllm.eval.records import read_records
    from nexus_vllm.eval.report import write_reports
    from nexus_vllm.eval.runner import config_dict, run_eval

    cfg = run_config(opts)
    peer_presses = _peer_presses(opts)
    out.mkdir(parents=True, exist_ok=True)
    _write_config(out, config_dict(cfg))

    if opts.get("report_only"):
        records = read_records(out / "records.jsonl", out / "kvpress_records.jsonl")
    else:
        from nexus_vllm.models import load_causal_lm

        path, tokenizer, model = load_causal_lm(cfg.model)
        print(f"nexus-vllm eval: model {path}, {threads} thread(s), out {out}", file=sys.stderr)
        records = run_eval(cfg, model, tokenizer, out, progress=not opts.get("no_progress"))
    if opts.get("peer") == "kvpress":
        from nexus_vllm.eval.peers import run_kvpress_peer

        records = records + run_kvpress_peer(cfg, out, presses=peer_presses)
    write_reports(out, cfg, records, calibrate=bool(opts.get("calibrate")))
    print(f"nexus-vllm eval: wrote {out}/results.json, table.md, plots", file=sys.stderr)
    if opts.get("publish") is not None:
        _publish(out, pathlib.Path(opts["publish"]))
    return 0


# What --publish copies: the reports, the records they came from and the run's config.
_PUBLISHED = ("*.md", "*.json", "*.jsonl", "*.png", "config.yaml")


def _publish(out: pathlib.Path, dest: pathlib.Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    copied = sorted({f for pattern in _PUBLISHED for f in out.glob(pattern) if f.is_file()})
    for f in copied:
        shutil.copy(f, dest / f.name)
    print(f"nexus-vllm eval: copied {len(copied)} files to {dest}", file=sys.stderr)


def _write_config(out: pathlib.Path, config: Mapping[str, object]) -> None:
    import yaml

    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
