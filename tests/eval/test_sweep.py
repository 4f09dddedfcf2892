"""``nexus-vllm sweep``: kept fractions, pooling over the tasks dense solves, the smallest
budget reaching a share of dense, and the command's outputs and errors."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from nexus_vllm.eval.records import Record, SampleId, write_records
from nexus_vllm.eval.sweep import main, smallest_reaching, sweep_points, table


def _record(task: str, index: int, method: str, budget: float | int | None, score: float,
            prompt_tokens: int = 2000) -> Record:
    return Record.build(SampleId(task, 2048, "question-last", index), method, budget, 0,
                        score=score, prediction="", answers=("x",), answer_loglik=-1.0,
                        dense_answer_loglik=-1.0, answer_tokens=1, kl=0.0, kl_answer=0.0,
                        prompt_tokens=prompt_tokens, cache_tokens=0, events=0, seconds=0.0)


def _family() -> list[Record]:
    """Two samples of a task dense solves (dense 1.0) and one task it does not (0.0):
    ``a`` reaches 0.5 at 400 tokens and 1.0 at 800, ``b`` 0.5 at 800 only."""
    recs = []
    for i, prompt in enumerate((1000, 4000)):
        recs.append(_record("solved", i, "dense", None, 1.0, prompt))
        recs.append(_record("unsolved", i, "dense", None, 0.0, prompt))
        for method, budget, score in (("a", 400, 0.5), ("a", 800, 1.0), ("b", 400, 0.0),
                                      ("b", 800, 0.5)):
            recs.append(_record("solved", i, method, budget, score, prompt))
            # The unsolved task's scores would change every mean if it were pooled.
            recs.append(_record("unsolved", i, method, budget, 1.0, prompt))
    return recs


def test_token_budgets_become_each_samples_kept_fraction() -> None:
    points = {(p.method, p.budget): p for p in sweep_points("f", _family())}
    # 400 tokens of 1000 and of 4000: 40% and 10%, 25% on the mean.
    assert points[("a", 400)].fraction == pytest.approx(0.25)
    assert points[("a", 800)].fraction == pytest.approx(0.5)
    assert points[("dense", None)].fraction == 1.0
    ratio = sweep_points("f", [_record("t", 0, "dense", None, 1.0),
                               _record("t", 0, "a", 0.3, 1.0)])
    assert [p.fraction for p in ratio if p.method == "a"] == [pytest.approx(0.3)]


def test_a_budget_larger_than_the_prompt_keeps_all_of_it() -> None:
    points = sweep_points("f", [_record("t", 0, "dense", None, 1.0, 500),
                                _record("t", 0, "a", 800, 1.0, 500)])
    assert [p.fraction for p in points if p.method == "a"] == [1.0]


def test_only_tasks_dense_solves_are_pooled() -> None:
    points = {(p.method, p.budget): p for p in sweep_points("f", _family())}
    assert points[("dense", None)].score == 1.0
    assert points[("a", 400)].score == 0.5
    assert points[("b", 400)].score == 0.0
    assert all(p.n == 2 and p.dense == 1.0 for p in points.values())


def test_the_smallest_budget_reaching_the_share() -> None:
    points = sweep_points("f", _family())
    a_half = smallest_reaching(points, "a", 0.5)
    assert a_half is not None and a_half.budget == 400
    a_all = smallest_reaching(points, "a", 1.0)
    assert a_all is not None and a_all.budget == 800
    b_half = smallest_reaching(points, "b", 0.5)
    assert b_half is not None and b_half.budget == 800
    assert smallest_reaching(points, "b", 0.9) is None
    assert smallest_reaching(points, "dense", 0.5) is None  # dense has no budget
    rows = table(points, 0.9).splitlines()
    assert rows[0] == "dense 1.00"
    assert "| a | 0.50 | 1.00 | 800 (50%) |" in rows
    assert "| b | 0.00 | 0.50 | not reached |" in rows


def test_a_family_without_dense_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="family 'f' has no dense records"):
        sweep_points("f", [_record("t", 0, "a", 400, 1.0)])
    with pytest.raises(ValueError, match="dense solves none"):
        sweep_points("f", [_record("t", 0, "dense", None, 0.0), _record("t", 0, "a", 4, 0.)])


def test_the_command_prints_tables_and_writes_the_plot_and_points(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    ours, peer = tmp_path / "ours.jsonl", tmp_path / "peer.jsonl"
    recs = _family()
    write_records(ours, [r for r in recs if r.method != "b"])
    write_records(peer, [r for r in recs if r.method == "b"])
    plot, points = tmp_path / "fig" / "plot.png", tmp_path / "fig" / "points.json"
    assert main([f"docs={ours},{peer}", f"again={ours}", "--share", "0.5",
                 "--plot", str(plot), "--json", str(points)]) == 0
    out = capsys.readouterr().out
    assert "## docs" in out and "## again" in out
    assert "| b | 0.00 | 0.50 | 800 (50%) |" in out
    assert plot.stat().st_size > 0
    data = json.loads(points.read_text())
    assert data["share"] == 0.5
    assert {(p["family"], p["method"]) for p in data["points"]} >= {("docs", "b"),
                                                                    ("again", "a")}


@pytest.mark.parametrize("argv, message", [
    (["nofamily.jsonl"], "a family is NAME=RECORDS.jsonl"),
    (["f=missing.jsonl"], "family 'f': no such records file missing.jsonl"),
    (["f=PLACEHOLDER", "--share", "1.5"], "--share must be in"),
])
def test_bad_arguments_name_what_is_wrong(argv: list[str], message: str, tmp_path: pathlib.Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    ours = tmp_path / "ours.jsonl"
    write_records(ours, _family())
    argv = [a.replace("PLACEHOLDER", str(ours)) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_record_in_several_files_counts_once_and_methods_can_be_chosen(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    ours, seeded = tmp_path / "ours.jsonl", tmp_path / "seeded.jsonl"
    recs = _family()
    write_records(ours, recs)
    # A seeded copy of the same keys with other scores: the first file's records win.
    write_records(seeded, [dataclasses.replace(r, score=0.0) if r.method == "a" else r
                           for r in recs])
    points = tmp_path / "points.json"
    assert main([f"f={ours},{seeded}", "--method", "a", "--json", str(points)]) == 0
    got = {(p["method"], p["budget"]): p for p in json.loads(points.read_text())["points"]}
    assert set(got) == {("dense", None), ("a", 400), ("a", 800)}
    assert got[("a", 800)]["score"] == 1.0 and got[("a", 800)]["n"] == 2
    assert "| b |" not in capsys.readouterr().out

