"""One evaluation run's result, as a typed record, and the ``records.jsonl`` it lives in.

A record is one (sample, method, budget, seed) run. On disk it is one JSON object per
line, keyed by :func:`record_key`, with the fields of :class:`Record` (any order). The
format is the one the project has always written, so existing ``records.jsonl`` files
(interrupted runs, ``docs/figures/*/records.jsonl``) resume and re-report unchanged.

``nexus-vllm records`` (:func:`main`) merges and filters record files, e.g. to seed a
run with another run's records (``scripts/run_eval.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["Record", "SampleId", "main", "read_records", "record_key", "record_writer",
           "select_records", "write_records"]


@dataclass(frozen=True)
class SampleId:
    """Which generated sample: its task, target prompt tokens, protocol and index."""

    task: str
    context: int
    protocol: str
    index: int

    def as_list(self) -> list[str | int]:
        return [self.task, self.context, self.protocol, self.index]


def record_key(sample: SampleId, method: str, budget: float | int | None, seed: int) -> str:
    """The resume key of a run: a JSON list, exactly as written since the first runs."""
    return json.dumps([*sample.as_list(), method, budget, seed])


# Optional per-turn fields (multi-turn streams only).
_PER_TURN = ("turn_scores", "turn_delta_loglik")


@dataclass(frozen=True)
class Record:
    """The metrics of one run (one line of ``records.jsonl``).

    ``method`` is the method's label (``"nexus:sampler=topk"``, ``"kvpress:snapkv"``);
    ``budget`` is None for dense; the log-likelihoods are in nats, summed over the
    ``answer_tokens`` reference tokens; ``kl`` is the mean per-token KL(dense || method)
    over question + answer, ``kl_answer`` over the answer only; ``events`` counts the
    prefill's eviction events; ``seconds`` is the run's wall time.

    A multi-turn stream (:mod:`nexus_vllm.eval.dialogues`) is one record: ``score`` is the
    mean over its turns, the log-likelihoods and ``answer_tokens`` are sums, both KLs are
    over the answers' tokens, ``prompt_tokens`` is the stream's length and ``events`` and
    ``cache_tokens`` are its last turn's; ``turn_scores`` and ``turn_delta_loglik`` keep
    each turn's (empty for single-question samples; older files lack them).
    """

    key: str
    task: str
    context: int
    protocol: str
    index: int
    method: str
    budget: float | int | None
    seed: int
    score: float
    prediction: str
    answers: tuple[str, ...]
    answer_loglik: float
    dense_answer_loglik: float
    delta_loglik: float
    answer_tokens: int
    kl: float
    kl_answer: float
    prompt_tokens: int
    cache_tokens: int
    events: int
    seconds: float
    turn_scores: tuple[float, ...] = ()
    turn_delta_loglik: tuple[float, ...] = ()

    @classmethod
    def build(cls, sample: SampleId, method: str, budget: float | int | None, seed: int, *,
              score: float, prediction: str, answers: Iterable[str], answer_loglik: float,
              dense_answer_loglik: float, answer_tokens: int, kl: float, kl_answer: float,
              prompt_tokens: int, cache_tokens: int, events: int,
              seconds: float, turn_scores: Iterable[float] = (),
              turn_delta_loglik: Iterable[float] = ()) -> Record:
        """A record for ``sample`` and a method run: the key and ``delta_loglik`` derived."""
        return cls(key=record_key(sample, method, budget, seed), task=sample.task,
                   context=sample.context, protocol=sample.protocol, index=sample.index,
                   method=method, budget=budget, seed=seed, score=score,
                   prediction=prediction, answers=tuple(answers), answer_loglik=answer_loglik,
                   dense_answer_loglik=dense_answer_loglik,
                   delta_loglik=answer_loglik - dense_answer_loglik,
                   answer_tokens=answer_tokens, kl=kl, kl_answer=kl_answer,
                   prompt_tokens=prompt_tokens, cache_tokens=cache_tokens, events=events,
                   seconds=seconds, turn_scores=tuple(turn_scores),
                   turn_delta_loglik=tuple(turn_delta_loglik))

    @property
    def sample(self) -> SampleId:
        return SampleId(self.task, self.context, self.protocol, self.index)

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["answers"] = list(self.answers)
        for name in _PER_TURN:
            if d[name]:
                d[name] = list(d[name])
            else:  # single-question records keep the format they always had
                del d[name]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Record:
        """Parse one ``records.jsonl`` object.

        Raises
        ------
        ValueError
            Naming the missing or unknown fields.
        """
        names = {f.name for f in fields(cls)}
        missing = sorted(names - set(data) - set(_PER_TURN))
        unknown = sorted(set(data) - names)
        if missing or unknown:
            raise ValueError(f"not a record: missing fields {missing}, unknown fields "
                             f"{unknown} (key {data.get('key')!r})")
        per_turn = {name: tuple(data.get(name, ())) for name in _PER_TURN}
        return cls(**{**data, "answers": tuple(data["answers"]), **per_turn})


def read_records(*paths: pathlib.Path) -> list[Record]:
    """The records of every file in ``paths`` that exists, in file then line order.

    Raises
    ------
    ValueError
        Naming the file and line of a line that is not a record.
    """
    out: list[Record] = []
    for path in paths:
        if not path.exists():
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                out.append(Record.from_dict(json.loads(line)))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: {exc}") from exc
    return out


@contextlib.contextmanager
def record_writer(path: pathlib.Path) -> Iterator[Callable[[Record], None]]:
    """Append records to ``path`` one line at a time, flushed, so a killed run resumes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        def write(rec: Record) -> None:
            fh.write(json.dumps(rec.to_dict()) + "\n")
            fh.flush()

        yield write


def write_records(path: pathlib.Path, records: Iterable[Record]) -> int:
    """Write ``records`` to ``path`` (replacing it); return how many."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r.to_dict()) + "\n" for r in records]
    path.write_text("".join(lines))
    return len(lines)


def _field_value(text: str) -> object:
    """A ``--where`` value: JSON when it parses (0.2, null, 2048), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_where(items: Sequence[str]) -> dict[str, object]:
    """``["FIELD=VALUE", ...]`` (the ``--where`` options) as a mapping.

    Raises
    ------
    ValueError
        For an item without ``=`` or without a field name.
    """
    where: dict[str, object] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise ValueError(f"--where must be FIELD=VALUE, got {item!r}")
        where[name] = _field_value(value)
    return where


def load_selected(parser: argparse.ArgumentParser, sources: Sequence[pathlib.Path],
                  where_items: Sequence[str],
                  exclude_method_prefixes: Sequence[str] = ()) -> list[Record]:
    """The records of ``sources`` that ``--where`` keeps, for a command line: every bad
    input (a malformed ``--where``, a missing file, an unknown field) is ``parser.error``."""
    try:
        where = parse_where(where_items)
        missing = [str(s) for s in sources if not s.exists()]
        if missing:
            raise ValueError(f"no such file(s): {', '.join(missing)}")
        return select_records(read_records(*sources), where=where,
                              exclude_method_prefixes=exclude_method_prefixes)
    except ValueError as exc:
        parser.error(str(exc))


def select_records(records: Sequence[Record], *, where: Mapping[str, object] | None = None,
                   exclude_method_prefixes: Sequence[str] = ()) -> list[Record]:
    """The records whose fields equal ``where`` and whose method starts with none of
    ``exclude_method_prefixes`` (order kept)."""
    where = where or {}
    names = {f.name for f in fields(Record)}
    unknown = sorted(set(where) - names)
    if unknown:
        raise ValueError(f"--where: unknown record field(s) {unknown}; fields: {sorted(names)}")
    return [r for r in records
            if all(getattr(r, k) == v for k, v in where.items())
            and not any(r.method.startswith(p) for p in exclude_method_prefixes)]


def rename_methods(records: Sequence[Record], renames: dict[str, str]) -> list[Record]:
    """``records`` with each method in ``renames`` relabelled (its key rebuilt): e.g. the
    records of ``nexus`` made before a default changed, named by the knobs they ran with."""
    return [dataclasses.replace(r, method=renames[r.method],
                                key=record_key(r.sample, renames[r.method], r.budget, r.seed))
            if r.method in renames else r for r in records]


def unique_records(records: Iterable[Record]) -> list[Record]:
    """The first record of each key (order kept): two runs seeded from the same records
    hold the seeded ones twice."""
    seen: set[str] = set()
    out = []
    for r in records:
        if r.key not in seen:
            seen.add(r.key)
            out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="nexus-vllm records",
        description="Merge and filter records.jsonl files (e.g. seed a run with another "
                    "run's records: identical keys are not recomputed). A key found in "
                    "several sources is kept once, from the first.")
    p.add_argument("sources", nargs="+", type=pathlib.Path, help="records.jsonl files")
    p.add_argument("--out", type=pathlib.Path, required=True, help="records.jsonl to write")
    p.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE",
                   help="keep records whose FIELD equals VALUE (JSON or a string); "
                        "repeatable, all must hold")
    p.add_argument("--exclude-method-prefix", action="append", default=[], metavar="PREFIX",
                   help="drop records whose method starts with PREFIX; repeatable")
    p.add_argument("--rename-method", action="append", default=[], nargs=2,
                   metavar=("OLD", "NEW"),
                   help="relabel method OLD as NEW (after --where); repeatable")
    p.add_argument("--if-missing", action="store_true",
                   help="do nothing when --out exists (it may hold a resumed run)")
    args = p.parse_args(argv)
    renames = dict(args.rename_method)
    if args.if_missing and args.out.exists():
        return 0
    kept = unique_records(rename_methods(load_selected(p, args.sources, args.where,
                                                       args.exclude_method_prefix), renames))
    n = write_records(args.out, kept)
    print(f"nexus-vllm records: wrote {n} records to {args.out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
