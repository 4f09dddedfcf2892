"""Eval records on disk: the published records parse, round-trip and filter; budgets parse."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from nexus_vllm.eval.budget import parse_budget
from nexus_vllm.eval.records import Record, SampleId, main, read_records, record_key

FIGURES = pathlib.Path(__file__).parents[2] / "docs" / "figures"
PUBLISHED = sorted(FIGURES.glob("*/*records.jsonl"))


def test_published_records_exist() -> None:
    assert {p.parent.name for p in PUBLISHED} >= {"headline", "sweep", "kvpress"}


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_published_records_round_trip(path: pathlib.Path) -> None:
    raw = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    records = read_records(path)
    assert [r.to_dict() for r in records] == raw
    for r in records:  # the key is derived from the fields, as the runner writes it
        assert r.key == record_key(r.sample, r.method, r.budget, r.seed)
        if math.isnan(r.answer_loglik):  # a server's record: no likelihoods at all
            assert math.isnan(r.delta_loglik) and math.isnan(r.dense_answer_loglik)
            continue
        assert r.delta_loglik == r.answer_loglik - r.dense_answer_loglik


def test_record_build_and_bad_lines(tmp_path: pathlib.Path) -> None:
    rec = Record.build(SampleId("vt", 700, "question-last", 3), "nexus:lam=0", 0.2, 1,
                       score=1.0, prediction=" x", answers=["x"], answer_loglik=-1.5,
                       dense_answer_loglik=-1.0, answer_tokens=2, kl=0.1, kl_answer=0.2,
                       prompt_tokens=680, cache_tokens=150, events=4, seconds=2.0)
    assert rec.key == '["vt", 700, "question-last", 3, "nexus:lam=0", 0.2, 1]'
    assert rec.delta_loglik == -0.5 and rec.answers == ("x",)
    assert Record.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec
    bad = tmp_path / "records.jsonl"
    bad.write_text(json.dumps(rec.to_dict()) + "\n" + json.dumps({"key": "k", "scor": 1}) + "\n")
    with pytest.raises(ValueError, match=r"records.jsonl:2: not a record: missing fields"):
        read_records(bad)
    assert read_records(tmp_path / "absent.jsonl") == []


def test_records_command_filters_like_the_old_grep(tmp_path: pathlib.Path) -> None:
    src = FIGURES / "headline" / "records.jsonl"
    out = tmp_path / "sweep" / "records.jsonl"
    argv = [str(src), "--where", "protocol=question-last", "--exclude-method-prefix", "nexus:",
            "--out", str(out)]
    assert main(argv) == 0
    # What scripts/run_eval.sh used to select with grep, line for line.
    expected = [x for x in src.read_text().splitlines()
                if '"question-last"' in x and '"method": "nexus:' not in x]
    assert out.read_text().splitlines() == expected
    out.write_text("")
    assert main([*argv, "--if-missing"]) == 0
    assert out.read_text() == ""  # kept: it may hold a resumed run
    assert main([str(src), "--where", "budget=null", "--out", str(out)]) == 0
    assert {r.method for r in read_records(out)} == {"dense"}


def test_records_command_renames_a_method_with_its_key(tmp_path: pathlib.Path) -> None:
    src = FIGURES / "headline" / "records.jsonl"
    out = tmp_path / "renamed.jsonl"
    assert main([str(src), "--where", "method=nexus", "--rename-method", "nexus",
                 "nexus:layer_stride=1", "--out", str(out)]) == 0
    before = [r for r in read_records(src) if r.method == "nexus"]
    after = read_records(out)
    assert len(after) == len(before) > 0
    for a, b in zip(after, before, strict=True):
        assert a.method == "nexus:layer_stride=1" and a.score == b.score
        assert a.key == record_key(b.sample, "nexus:layer_stride=1", b.budget, b.seed) != b.key


def test_records_command_keeps_each_key_once(tmp_path: pathlib.Path) -> None:
    """Two runs seeded from the same records, merged: the seeded records appear once."""
    src = FIGURES / "headline" / "records.jsonl"
    lines = src.read_text().splitlines()
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(lines[:10]) + "\n")
    b.write_text("\n".join(lines[5:15]) + "\n")
    out = tmp_path / "merged.jsonl"
    assert main([str(a), str(b), "--out", str(out)]) == 0
    assert out.read_text().splitlines() == lines[:15]


@pytest.mark.parametrize("argv, match", [
    (["--where", "protocl=question-last"], "unknown record field"),
    (["--where", "protocol"], "FIELD=VALUE"),
    (["--rename-method", "nexus"], "expected 2 arguments"),
])
def test_records_command_rejects_bad_filters(tmp_path, capsys, argv, match) -> None:
    src = FIGURES / "headline" / "records.jsonl"
    with pytest.raises(SystemExit) as exc:
        main([str(src), "--out", str(tmp_path / "x.jsonl"), *argv])
    assert exc.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize("value, expected", [
    ("0.2", 0.2), ("1e-1", 0.1), (" 512 ", 512), ("1.0", 1.0), (0.5, 0.5), (256, 256),
])
def test_parse_budget(value, expected) -> None:
    got = parse_budget(value)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("value", ["abc", "", "nan", True])
def test_parse_budget_rejects(value) -> None:
    with pytest.raises(ValueError, match="budget"):
        parse_budget(value)
