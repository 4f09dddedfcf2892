"""Paired comparison of two methods on the same samples (the README's "better / worse /
not distinguishable") and the `nexus-vllm compare` command."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from nexus_vllm.eval.compare import main as compare_main
from nexus_vllm.eval.records import Record, SampleId, write_records
from nexus_vllm.eval.stats import paired_comparison, sign_test


def _rec(method: str, index: int, seed: int, score: float, kl: float = 0.5,
         task: str = "t") -> Record:
    return Record.build(SampleId(task, 2048, "question-last", index), method, 0.2, seed,
                        score=score, prediction="", answers=("a",), answer_loglik=-2.0,
                        dense_answer_loglik=-1.0, answer_tokens=1, kl=kl, kl_answer=kl,
                        prompt_tokens=10, cache_tokens=5, events=1, seconds=1.0)


def test_sign_test_exact_values() -> None:
    assert sign_test(0, 0) == 1.0
    assert sign_test(5, 0) == pytest.approx(2 / 32)  # 2 * (1/2)^5
    assert sign_test(8, 2) == pytest.approx(2 * sum(math.comb(10, i) for i in range(3)) / 1024)
    assert sign_test(3, 3) == 1.0


def test_paired_comparison_pairs_samples_and_averages_seeds() -> None:
    # a wins by 1 on every sample once its two seeds are averaged; b ran one extra sample.
    recs = [_rec("a", i, s, 1.0 if s == 0 else 0.5) for i in range(20) for s in range(2)]
    recs += [_rec("b", i, 0, -0.25) for i in range(21)]
    c = paired_comparison(recs, "a", "b")
    assert (c.n, c.wins, c.losses, c.ties) == (20, 20, 0, 0)
    assert c.mean_diff == pytest.approx(1.0) and c.verdict == "better"
    assert c.p_sign == pytest.approx(2 / 2**20)
    assert paired_comparison(recs, "b", "a").verdict == "worse"


def test_paired_comparison_lower_kl_is_better_and_noise_is_undecided() -> None:
    recs = [_rec("a", i, 0, 0.0, kl=0.1) for i in range(10)]
    recs += [_rec("b", i, 0, 0.0, kl=0.4) for i in range(10)]
    assert paired_comparison(recs, "a", "b", metric="kl").verdict == "better"
    tied = paired_comparison(recs, "a", "b", metric="score")
    assert tied.verdict == "not distinguishable" and tied.ties == 10 and tied.p_sign == 1.0
    mixed = [_rec("a", i, 0, float(i % 2)) for i in range(10)]
    mixed += [_rec("b", i, 0, float((i + 1) % 2)) for i in range(10)]
    assert paired_comparison(mixed, "a", "b").verdict == "not distinguishable"


def test_paired_comparison_rejects_bad_input() -> None:
    recs = [_rec("a", 0, 0, 1.0), _rec("b", 1, 0, 1.0)]
    with pytest.raises(ValueError, match="share no sample"):
        paired_comparison(recs, "a", "b")
    with pytest.raises(ValueError, match="metric"):
        paired_comparison(recs, "a", "b", metric="accuracy")


def test_compare_command(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = [_rec("nexus", i, 0, 1.0, task=t) for i in range(6) for t in ("x", "y")]
    recs += [_rec("snapkv", i, 0, 0.0 if t == "x" else 1.0, task=t)
             for i in range(6) for t in ("x", "y")]
    path = tmp_path / "records.jsonl"
    write_records(path, recs)
    out = tmp_path / "cmp.json"
    assert compare_main([str(path), "--a", "nexus", "--b", "snapkv", "--metric", "score",
                         "--task", "x", "--json", str(out)]) == 0
    assert "nexus vs snapkv on score: better" in capsys.readouterr().out
    (saved,) = json.loads(out.read_text())
    assert saved["n"] == 6 and saved["wins"] == 6
    assert compare_main([str(path), "--a", "nexus", "--b", "snapkv", "--metric", "score",
                         "--task", "y"]) == 0
    assert "not distinguishable" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        compare_main([str(path), "--a", "nexus", "--b", "h2o"])
