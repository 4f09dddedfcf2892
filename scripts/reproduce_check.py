"""Do published evaluation runs reproduce at HEAD? Re-runs a slice of each named run under
``docs/figures/`` with the code of a git ref and compares the new records with the
published ones, record by record.

    .venv/bin/python scripts/reproduce_check.py [RUN ...] [--samples 1] [--methods 'a;b']
        [--tolerance 0] [--ref HEAD | --ref worktree] [--compare-only]

For each run (default: ``chat_report``, ``stream_longdoc``, ``stream_multiturn``: the
report set in prompt mode ``end`` (the chat shape's defaults, seven tasks), and the
streaming regime on long documents and on a multi-turn chat; all block granularity), its
published ``config.yaml`` is run again through ``nexus-vllm eval`` with ``--samples N``
(the first N samples of each task: a sample is generated from ``(task, data_seed,
index)`` alone, so they are the published run's first N) and the methods its
``records.jsonl`` holds (``--methods`` picks a subset), into ``runs/reproduce/<run>/``
(emptied first). A method a run's records name that is no longer a mode is left out
(:data:`RETIRED`). The published config's ``contexts`` and ``protocols`` are passed as
``--context``/``--protocol``: ``--config`` reads the singular keys only, and would
otherwise run every protocol.

Not in the default set: ``headline`` and the other runs published before the defaults
changed (``headline``'s ``config.yaml`` says ``knobs: {}``: it ran with the defaults of
then, prompt mode ``stream`` among them, so today's run of it is another experiment: 0 of
its first 96 records identical, 1 event per prompt where 4 were published), and the
head-granularity runs (``stream_head_*``, whose selection rule changed on purpose at
1e8deba).

The code run is ``git archive <ref>`` of ``nexus_vllm/`` and ``configs/`` in a temporary
directory (default HEAD: uncommitted edits in the checkout play no part); ``--ref
worktree`` runs the checkout as it is.

Records are matched on their key (task, context, protocol, sample index, method, budget,
seed). Every field but ``seconds`` is compared: numbers and lists of numbers by their
largest absolute difference, the texts (prediction, answers) for equality. One line per
run: records compared, identical, the largest |diff| of each metric. Exits 1 when a record
is missing on either side, a text differs, or a number differs by more than
``--tolerance`` (default 0: bitwise; the harness runs at one thread, and two runs of the
default slice gave the same records bit for bit). Published records known to differ
(:data:`KNOWN`: each traced to the commit that changed them, or to a rerun outside the
run) are shown on their own lines with their largest |diff| and fail the check only with
``--strict``.

Time: the default slice (one sample per task: 70 + 16 + 8 = 94 runs, every published
method of the three runs but the retired one, every task) takes about 15 minutes on two busy
CPU cores (chat_report 10, stream_longdoc 2.5, stream_multiturn 2.2); ``--samples 2`` doubles it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
DEFAULT_RUNS = ("chat_report", "stream_longdoc", "stream_multiturn")
# Methods whose label no longer runs what the records measured (docs/results.md says where
# they reproduce): the run's records keep them, the check leaves them out.
RETIRED = {"chat_report": ("nexus:prefill_direct=max_normalized",)}
# Published records known not to be reproducible at HEAD, and why (each traced by running
# the record's commit): their differences are shown, and fail the check only with --strict.
_PRIOR_ALONE = ("rerun alone at 58f0ad1 against a dense pass up to 5e-4 nats off the run's "
                "own dense records; 58f0ad1's code gives HEAD's numbers (checked on "
                "stream_longdoc's first sample)")
KNOWN = {
    ("chat_report", "nexus:prompt_mode=stream"):
        "published at 4e18065, before d92bcfa gave stream mode its own defaults on purpose "
        "(d92bcfa^ reproduces the records, d92bcfa changes them; 8a8c7c3 and 9ea1101 "
        "changed stream since)",
    ("stream_multiturn", "nexus:expected=0,knorm_prior=0"):
        "published at aa4c303, before 8a8c7c3 changed stream's last-chunk event on purpose "
        "(8a8c7c3^ reproduces the record, 8a8c7c3 gives HEAD's)",
    ("stream_longdoc", "nexus:expected=0,knorm_prior=4"): _PRIOR_ALONE,
    ("stream_multiturn", "nexus:expected=0,knorm_prior=4"): _PRIOR_ALONE,
}
KEY_FIELDS = ("task", "context", "protocol", "index", "method", "budget", "seed")
SKIPPED = frozenset({"key", "seconds"})  # the key is compared as its fields; timings vary

Record = dict[str, object]


def read_jsonl(path: pathlib.Path) -> list[Record]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def record_key(r: Record) -> tuple[object, ...]:
    return tuple(r.get(k) for k in KEY_FIELDS)


def split_methods(text: str) -> list[str]:
    """The CLI's method list: ';'-separated when a method carries knobs, else ',' or ';'."""
    sep = ";" if ":" in text or ";" in text else ","
    return [m.strip() for m in text.split(sep) if m.strip()]


def as_list(v: object) -> list[object]:
    """A YAML value as a list (a scalar is one item, null none)."""
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [v]


def published_methods(config: dict[str, object], records: Iterable[Record]) -> list[str]:
    """The methods of the published records, in the config's order."""
    seen = {str(r["method"]) for r in records}
    listed = [str(m) for m in as_list(config.get("methods")) if str(m) in seen]
    return listed + sorted(seen - set(listed))


def _numbers(v: object) -> list[float] | None:
    """``v`` as a list of floats when it is a number or a list of numbers, else None."""
    if isinstance(v, bool):
        return [float(v)]
    if isinstance(v, (int, float)):
        return [float(v)]
    if isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                   for x in v):
        return [float(x) for x in v]
    return None


def field_diff(a: object, b: object) -> float | None:
    """Largest |a - b| for numbers (0.0 when equal, inf when shapes differ); None for
    other values (texts, lists of texts, null), compared for equality by the caller."""
    na, nb = _numbers(a), _numbers(b)
    if na is None or nb is None:
        return None
    if len(na) != len(nb):
        return math.inf
    worst = 0.0
    for x, y in zip(na, nb):
        if x == y or (math.isnan(x) and math.isnan(y)):
            continue
        worst = max(worst, abs(x - y) if not (math.isnan(x) or math.isnan(y)) else math.inf)
    return worst


class Comparison:
    """Published against new records of one run."""

    def __init__(self, published: list[Record], new: list[Record], tolerance: float,
                 known: dict[str, str] | None = None) -> None:
        self.tolerance = tolerance
        self.known = known or {}  # method -> why its published records differ
        self.known_diffs: dict[str, int] = {}
        self.known_max: dict[str, float] = {}
        pub = {record_key(r): r for r in published}
        got = {record_key(r): r for r in new}
        self.missing = sorted((k for k in pub if k not in got), key=repr)
        self.extra = sorted((k for k in got if k not in pub), key=repr)
        self.compared = 0
        self.identical = 0
        self.max_diff: dict[str, float] = {}
        self.text_diffs: dict[str, int] = {}
        self.worst: list[tuple[float, tuple[object, ...], str, object, object]] = []
        for k in sorted(set(pub) & set(got), key=repr):
            self._compare(k, pub[k], got[k])

    def _compare(self, key: tuple[object, ...], p: Record, g: Record) -> None:
        self.compared += 1
        method = str(p.get("method"))
        if method in self.known:
            self._compare_known(method, p, g)
            return
        same = True
        for f in sorted((set(p) | set(g)) - SKIPPED - set(KEY_FIELDS)):
            a, b = p.get(f), g.get(f)
            d = field_diff(a, b)
            if d is None:
                self.text_diffs.setdefault(f, 0)
                if a != b:
                    self.text_diffs[f] += 1
                    same = False
                    self.worst.append((math.inf, key, f, a, b))
                continue
            self.max_diff[f] = max(self.max_diff.get(f, 0.0), d)
            if d > 0 or a != b:
                same = False
                self.worst.append((d, key, f, a, b))
        self.identical += same

    def _compare_known(self, method: str, p: Record, g: Record) -> None:
        """A record of a known difference: counted, its largest |diff| kept aside."""
        fields = (set(p) | set(g)) - SKIPPED - set(KEY_FIELDS)
        if all(p.get(f) == g.get(f) for f in fields):
            self.identical += 1
            return
        self.known_diffs[method] = self.known_diffs.get(method, 0) + 1
        for f in sorted(fields):
            d = field_diff(p.get(f), g.get(f))
            if d is None:
                d = 0.0 if p.get(f) == g.get(f) else math.inf
            key = f"{method}/{f}"
            if d > 0:
                self.known_max[key] = max(self.known_max.get(key, 0.0), d)

    @property
    def ok(self) -> bool:
        return (not self.missing and not self.extra and self.compared > 0
                and not any(self.text_diffs.values())
                and all(d <= self.tolerance for d in self.max_diff.values()))

    def line(self, name: str) -> str:
        diffs = " ".join(f"{f}={d:.3g}" for f, d in sorted(self.max_diff.items()))
        texts = " ".join(f"{f}:{n}" for f, n in sorted(self.text_diffs.items()))
        out = (f"{name}: {self.compared} records compared, {self.identical} identical; "
               f"max |diff| {diffs}; texts differing {texts}")
        if self.missing or self.extra:
            out += f"; missing {len(self.missing)}, unpublished {len(self.extra)}"
        if self.known_diffs:
            out += "; known differences " + ", ".join(
                f"{m} {n}" for m, n in sorted(self.known_diffs.items()))
        return out + ("  OK" if self.ok else "  DIFFERS")

    def known_lines(self) -> list[str]:
        out = []
        for m, n in sorted(self.known_diffs.items()):
            diffs = " ".join(f"{k.split('/', 1)[1]}={d:.3g}" if d < math.inf
                             else f"{k.split('/', 1)[1]} differs"
                             for k, d in sorted(self.known_max.items())
                             if k.split("/", 1)[0] == m)
            out.append(f"    known: {m} ({n} records; max |diff| {diffs}): {self.known[m]}")
        return out

    def details(self, limit: int) -> list[str]:
        worst: dict[str, tuple[float, tuple[object, ...], str, object, object]] = {}
        for w in sorted(self.worst, key=lambda w: -w[0]):
            worst.setdefault(w[2], w)  # the largest difference of each field first
        rest = [w for w in sorted(self.worst, key=lambda w: -w[0]) if w not in worst.values()]
        rows = [*worst.values(), *rest][:limit]
        out = [f"    {list(k)} {f}: published {a!r} now {b!r} (|diff| {d:.3g})"
               for d, k, f, a, b in rows]
        out += [f"    missing now: {list(k)}" for k in self.missing[:limit]]
        out += [f"    not published: {list(k)}" for k in self.extra[:limit]]
        return out


def export_ref(ref: str, dest: pathlib.Path) -> str:
    """``git archive`` the package of ``ref`` into ``dest``; return the commit."""
    commit = subprocess.run(["git", "rev-parse", "--short", f"{ref}^{{commit}}"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit, "nexus_vllm", "configs",
                              "pyproject.toml"], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return commit


def run_eval(name: str, config: dict[str, object], samples: int, methods: list[str],
             out: pathlib.Path, code: pathlib.Path, progress: bool) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "nexus_vllm.cli", "eval",
           "--config", str(FIGURES / name / "config.yaml"), "--samples", str(samples),
           "--methods", ";".join(methods), "--out", str(out)]
    for flag, key in (("--context", "contexts"), ("--protocol", "protocols")):
        values = as_list(config.get(key))
        if values:
            cmd += [flag, ",".join(str(v) for v in values)]
    if not progress:
        cmd.append("--no-progress")
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
           "PYTHONPATH": str(code)}
    subprocess.run(cmd, cwd=code, env=env, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("runs", nargs="*", default=list(DEFAULT_RUNS),
                    help=f"run names under docs/figures (default {' '.join(DEFAULT_RUNS)})")
    ap.add_argument("--samples", type=int, default=1, help="samples per task (default 1)")
    ap.add_argument("--methods", default=None,
                    help="methods to re-run, ';'-separated (default: all published ones)")
    ap.add_argument("--tolerance", type=float, default=0.0,
                    help="largest |diff| a number may have (default 0: bitwise)")
    ap.add_argument("--ref", default="HEAD",
                    help="git ref whose code runs (default HEAD); 'worktree' runs the checkout")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "runs" / "reproduce")
    ap.add_argument("--compare-only", action="store_true",
                    help="compare the records already under --out, run nothing")
    ap.add_argument("--strict", action="store_true",
                    help="count the known differences (KNOWN) as failures too")
    ap.add_argument("--progress", action="store_true", help="the eval's progress bars")
    ap.add_argument("--details", type=int, default=12, help="differing records shown per run")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="reproduce_") as tmp:
        if args.compare_only:
            code, where = ROOT, "records already under --out"
        elif args.ref == "worktree":
            code, where = ROOT, "the checkout as it is"
        else:
            code = pathlib.Path(tmp)
            where = f"commit {export_ref(args.ref, code)}"
        import torch  # the version the published runs name

        print(f"reproduce_check: {where}, torch {torch.__version__}, {args.samples} "
              f"sample(s) per task, tolerance {args.tolerance:g}", flush=True)
        failed = False
        for name in args.runs:
            run_dir = FIGURES / name
            config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
            published = read_jsonl(run_dir / "records.jsonl")
            methods = [m for m in published_methods(config, published)
                       if m not in RETIRED.get(name, ())]
            if args.methods:
                wanted = split_methods(args.methods)
                unknown = [m for m in wanted if m not in methods]
                if unknown:
                    raise SystemExit(f"{name}: no published records of {unknown}")
                methods = [m for m in methods if m in wanted or m == "dense"]
            if config.get("torch") and config["torch"] != str(torch.__version__):
                print(f"{name}: published with torch {config['torch']}", flush=True)
            out = args.out / name
            start = time.monotonic()
            if not args.compare_only:
                run_eval(name, config, args.samples, methods, out, code, args.progress)
            elapsed = time.monotonic() - start
            chosen = [r for r in published if int(str(r["index"])) < args.samples
                      and r["method"] in methods]
            new = read_jsonl(out / "records.jsonl")
            known = {} if args.strict else {m: why for (run, m), why in KNOWN.items()
                                             if run == name}
            cmp = Comparison(chosen, new, args.tolerance, known)
            print(cmp.line(name) + (f"  ({elapsed / 60:.1f} min)" if elapsed > 1 else ""),
                  flush=True)
            print("\n".join(cmp.known_lines()), flush=True)
            if not cmp.ok:
                failed = True
                print("\n".join(cmp.details(args.details)), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
