"""The eval runner end to end on a tiny random Llama (plumbing, files, resume, statistics)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from nexus_vllm.eval.cli import main
from nexus_vllm.eval.runner import aggregate, bootstrap_ci, parse_method
from nexus_vllm.hf.testing import byte_tokenizer, tiny_llama

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tok = byte_tokenizer()
    tiny_llama(vocab_size=len(tok), eos_token_id=tok.eos_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_cli_end_to_end_and_resume(tiny_dir, tmp_path) -> None:
    out = tmp_path / "run"
    argv = ["--model", str(tiny_dir), "--tasks", "niah_single_noise,vt",
            "--methods", "dense,nexus,streaming", "--budgets", "0.3,0.5", "--context", "700",
            "--samples", "2", "--seeds", "2", "--protocol", "question-last,question-first",
            "--chunk-size", "128", "--no-progress", "--out", str(out),
            "--knobs", json.dumps({"block_size": 8, "recent_blocks": 2, "skip_layers": 1})]
    assert main(argv) == 0
    records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    # 2 tasks x 2 samples x 2 protocols x (dense + nexus 2 budgets x 2 seeds + streaming 2)
    assert len(records) == 2 * 2 * 2 * (1 + 4 + 2)
    for r in records:
        assert 0.0 <= r["score"] <= 1.0
        if r["method"] == "dense":
            assert r["kl"] == 0.0 and r["delta_loglik"] == 0.0
            assert r["cache_tokens"] == r["prompt_tokens"]
        else:
            assert r["events"] > 0
            assert r["cache_tokens"] < r["prompt_tokens"]
            assert r["kl"] >= 0.0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["budgets"] == [0.3, 0.5]
    assert yaml.safe_load((out / "config.yaml").read_text())["methods"] == [
        "dense", "nexus", "streaming"]
    for name in ("table.md", "plot_score.png", "plot_kl.png", "plot_delta_loglik.png",
                 "bars_score_0.3.png"):
        assert (out / name).stat().st_size > 0
    assert "| nexus |" in (out / "table.md").read_text()
    # Resume: nothing left to run, same records.
    assert main(argv) == 0
    again = (out / "records.jsonl").read_text().splitlines()
    assert len(again) == len(records)


def test_calibrate_writes_dense_table(tiny_dir, tmp_path) -> None:
    out = tmp_path / "cal"
    assert main(["--model", str(tiny_dir), "--calibrate", "--tasks", "passkey",
                 "--context", "400,600", "--samples", "1", "--protocol", "question-last",
                 "--no-progress", "--out", str(out)]) == 0
    text = (out / "calibration.md").read_text()
    assert "| passkey |" in text and "question-last @ 400" in text


def test_parse_method() -> None:
    spec = parse_method("nexus:sampler=ares,n=8,lam=0.25")
    assert spec.method == "nexus" and spec.knobs == {"sampler": "ares", "n": 8, "lam": 0.25}
    assert spec.stochastic
    assert not parse_method("nexus:sampler=topk").stochastic
    assert not parse_method("snapkv").stochastic
    with pytest.raises(ValueError):
        parse_method("nexus:lam")


def test_bootstrap_ci_and_aggregate() -> None:
    m, lo, hi = bootstrap_ci([1.0, 1.0, 1.0])
    assert (m, lo, hi) == (1.0, 1.0, 1.0)
    x = np.random.default_rng(0).normal(size=200)
    m, lo, hi = bootstrap_ci(x)
    assert lo < m < hi and abs(m) < 0.2 and 0.1 < hi - lo < 0.5
    recs = [dict(task="t", context=1, protocol="p", method="nexus", budget=0.2, index=i,
                 seed=s, score=float(i % 2), delta_loglik=-1.0, kl=0.5, kl_answer=0.7,
                 seconds=1.0)
            for i in range(4) for s in range(3)]
    (row,) = aggregate(recs)
    assert row["n"] == 4 and row["runs"] == 12 and row["score"] == 0.5
    assert row["delta_loglik"] == -1.0 and row["kl_lo"] == row["kl_hi"] == 0.5
