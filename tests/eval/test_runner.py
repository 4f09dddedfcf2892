"""The eval runner end to end on a tiny random Llama (plumbing, files, resume, statistics)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
import yaml

from nexus_vllm.eval.cli import main
from nexus_vllm.eval.records import Record, SampleId, read_records
from nexus_vllm.eval.runner import RunConfig, iter_runs, parse_method
from nexus_vllm.eval.stats import aggregate, bootstrap_ci
from nexus_vllm.hf.testing import save_tiny_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # The in-memory tests' model shape (hf.testing.tiny_llama) with the byte tokenizer.
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tokenizer="byte", layers=3,
                                heads=4, kv_heads=2, head_dim=16)


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
    # Resume: nothing left to run, same records; --publish copies the run's files.
    pub = tmp_path / "published"
    assert main([*argv, "--publish", str(pub)]) == 0
    again = (out / "records.jsonl").read_text().splitlines()
    assert len(again) == len(records)
    assert (pub / "records.jsonl").read_text().splitlines() == again
    for name in ("table.md", "results.json", "config.yaml", "plot_score.png"):
        assert (pub / name).read_bytes() == (out / name).read_bytes()


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


def _record(index: int, seed: int, score: float) -> Record:
    return Record.build(SampleId("t", 1, "p", index), "nexus", 0.2, seed, score=score,
                        prediction="", answers=("a",), answer_loglik=-2.0,
                        dense_answer_loglik=-1.0, answer_tokens=1, kl=0.5, kl_answer=0.7,
                        prompt_tokens=10, cache_tokens=5, events=1, seconds=1.0)


def test_bootstrap_ci_and_aggregate() -> None:
    m, lo, hi = bootstrap_ci([1.0, 1.0, 1.0])
    assert (m, lo, hi) == (1.0, 1.0, 1.0)
    x = np.random.default_rng(0).normal(size=200)
    m, lo, hi = bootstrap_ci(x)
    assert lo < m < hi and abs(m) < 0.2 and 0.1 < hi - lo < 0.5
    recs = [_record(i, s, float(i % 2)) for i in range(4) for s in range(3)]
    (row,) = aggregate(recs)
    assert row["n"] == 4 and row["runs"] == 12 and row["score"] == 0.5
    assert row["delta_loglik"] == -1.0 and row["kl_lo"] == row["kl_hi"] == 0.5


def _cfg(**kw) -> RunConfig:
    base = dict(model="m", tasks=("vt",), methods=("dense", "nexus", "snapkv"), budgets=(0.2,),
                contexts=(700,), protocols=("question-last",), samples=2, seeds=3, data_seed=1)
    return RunConfig(**{**base, **kw})


def test_iter_runs_order_and_keys() -> None:
    runs = list(iter_runs(_cfg()))
    # per sample: dense, nexus x 3 seeds (stochastic), snapkv x 1 seed
    assert len(runs) == 2 * (1 + 3 + 1)
    assert [r.method.label for r in runs[:5]] == ["dense", "nexus", "nexus", "nexus", "snapkv"]
    assert runs[0].key == '["vt", 700, "question-last", 0, "dense", null, 0]'
    assert runs[3].key == '["vt", 700, "question-last", 0, "nexus", 0.2, 2]'
    assert runs[5].sample == SampleId("vt", 700, "question-last", 1)


@pytest.mark.parametrize("kw, match", [
    ({"budgets": (1.5,)}, "'nexus' at budget 1.5: budget as a ratio"),
    ({"budgets": (0,)}, "positive token count"),
    ({"budgets": (64,)}, "max_tokens must be >="),  # below the forced blocks at block 32
    ({"knobs": {"lamda": 0.5}}, "did you mean 'lam'"),
    ({"methods": ("nexus:lam",)}, "key=value"),
    ({"samples": 0}, "samples and seeds"),
])
def test_run_config_checks_every_method_and_budget_up_front(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_a_run_pins_a_policy_knob_for_the_methods_that_take_it() -> None:
    cfg = _cfg(knobs={"prefill_direct": "mean", "recent_blocks": 4},
               methods=("dense", "nexus", "snapkv", "nexus:lam=0"))
    nexus, snapkv, lam0 = (parse_method(m) for m in cfg.methods[1:])
    assert cfg.knobs_for(nexus) == {"prefill_direct": "mean", "recent_blocks": 4}
    assert cfg.knobs_for(snapkv) == {"recent_blocks": 4}  # not a SnapKV knob: left out
    assert cfg.knobs_for(lam0) == {"prefill_direct": "mean", "recent_blocks": 4, "lam": 0}
    with pytest.raises(ValueError, match="prefill_direct"):
        _cfg(knobs={"prefill_direct": "median"})  # still checked where it applies


def test_report_only_reproduces_the_published_tables(tmp_path) -> None:
    """docs/figures/headline re-reported by today's code: same tables, same results."""
    import pathlib
    import shutil

    src = pathlib.Path(__file__).parents[2] / "docs" / "figures" / "headline"
    out = tmp_path / "headline"
    out.mkdir()
    shutil.copy(src / "records.jsonl", out)
    config = pathlib.Path(__file__).parents[2] / "configs" / "eval" / "headline.yaml"
    assert main(["--config", str(config), "--out", str(out), "--report-only"]) == 0
    # The first line names the run directory.
    assert (out / "table.md").read_text().splitlines()[1:] == \
        (src / "table.md").read_text().splitlines()[1:]
    assert json.loads((out / "results.json").read_text())["rows"] == \
        json.loads((src / "results.json").read_text())["rows"]
    assert read_records(out / "records.jsonl")[0].to_dict() == \
        json.loads((src / "records.jsonl").read_text().splitlines()[0])


def test_report_names_how_each_task_is_scored(tmp_path) -> None:
    """docs/figures/chat_report re-reported: its score section says the summary is scored
    by ROUGE-L F1 against dense's answer (the other tasks by string match; a run without
    the summary keeps the string-match title: the headline test above)."""
    src = pathlib.Path(__file__).parents[2] / "docs" / "figures" / "chat_report"
    out = tmp_path / "chat_report"
    out.mkdir()
    # Less the run of a prompt-end mode since removed (its commit, docs/algorithm.md,
    # reports it): its config no longer validates.
    removed = "nexus:prefill_direct=max_normalized"
    (out / "records.jsonl").write_text("".join(
        line for line in (src / "records.jsonl").read_text().splitlines(keepends=True)
        if json.loads(line)["method"] != removed))
    config = yaml.safe_load((src / "config.yaml").read_text())
    config["methods"].remove(removed)
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["--config", str(out / "config.yaml"), "--out", str(out),
                 "--report-only"]) == 0
    table = (out / "table.md").read_text()
    assert table.splitlines()[1:] == [line for line in (src / "table.md").read_text()
                                      .splitlines()[1:] if removed not in line]
    assert ("## Score (0-1; RULER string match, summary: ROUGE-L F1 against dense's answer)"
            " at budget 0.2") in table


@pytest.mark.parametrize(
    "path", sorted((pathlib.Path(__file__).parents[2] / "configs" / "eval").glob("*.yaml")),
    ids=lambda p: p.stem)
def test_every_committed_eval_config_is_valid(path: pathlib.Path) -> None:
    """Each configs/eval file builds its RunConfig (tasks, methods, knobs, budgets checked),
    so a stale knob (e.g. a removed prefill score) fails here, not hours into a run."""
    from nexus_vllm.eval.cli import _merge, build_parser, run_config

    cfg = run_config(_merge(build_parser().parse_args(["--config", str(path)])))
    assert cfg.tasks and cfg.methods


def test_a_published_config_runs_what_was_published(tmp_path: pathlib.Path) -> None:
    """A run's config.yaml (config_dict: contexts, protocols, torch) read back with
    --config gives the same RunConfig; an unknown key is refused, naming it."""
    from nexus_vllm.eval.cli import _merge, _write_config, build_parser, run_config
    from nexus_vllm.eval.runner import config_dict

    argv = ["--tasks", "niah_multikey", "--methods", "dense;knorm", "--budgets", "416",
            "--context", "1024", "--protocol", "question-last", "--samples", "3"]
    cfg = run_config(_merge(build_parser().parse_args(argv)))
    _write_config(tmp_path, config_dict(cfg))
    again = run_config(_merge(build_parser().parse_args(
        ["--config", str(tmp_path / "config.yaml")])))
    assert again == cfg
    typo = tmp_path / "typo.yaml"
    typo.write_text("tasks: [niah_multikey]\nprotocols: [chat]\nsample: 3\n")
    with pytest.raises(SystemExit, match="unknown key.*sample;"):
        _merge(build_parser().parse_args(["--config", str(typo)]))


def test_run_config_names_a_bad_knob(tmp_path: pathlib.Path) -> None:
    from nexus_vllm.eval.cli import _merge, build_parser, run_config

    bad = tmp_path / "bad.yaml"
    bad.write_text("tasks: [niah_single_noise]\nmethods: ['nexus:prefill_indirect=hub']\n")
    with pytest.raises(SystemExit, match="prefill_indirect='hub' was removed"):
        run_config(_merge(build_parser().parse_args(["--config", str(bad)])))


def test_dialogue_tasks_one_record_per_stream_every_turn_scored(tiny_dir, tmp_path) -> None:
    out = tmp_path / "dialogues"
    argv = ["--model", str(tiny_dir), "--tasks", "multiturn,longgen",
            "--methods", "dense;nexus;nexus:sampler=topk", "--budgets", "1024",
            "--context", "7000", "--samples", "1", "--seeds", "1",
            "--protocol", "question-last,question-first", "--chunk-size", "256",
            "--no-progress", "--out", str(out),
            "--knobs", json.dumps({"block_size": 32, "skip_layers": 1,
                                   "prompt_mode": "stream"})]
    assert main(argv) == 0
    records = read_records(out / "records.jsonl")
    # One protocol per stream (its questions follow their material), three methods.
    assert sorted((r.task, r.protocol, r.method) for r in records) == sorted(
        (t, "question-last", m) for t in ("multiturn", "longgen")
        for m in ("dense", "nexus", "nexus:sampler=topk"))
    for r in records:
        turns = 6 if r.task == "multiturn" else 1
        assert len(r.turn_scores) == len(r.turn_delta_loglik) == len(r.answers) == turns
        assert r.score == pytest.approx(sum(r.turn_scores) / turns)
        assert r.delta_loglik == pytest.approx(sum(r.turn_delta_loglik), abs=1e-6)
        assert r.prediction.count(" | ") == turns - 1
        if r.method == "dense":
            assert r.kl == 0.0 and r.events == 0 and r.cache_tokens > 6000
        else:
            assert r.events > 3 and r.cache_tokens <= 1024 + 256
            assert r.kl > 0.0
    # Per-turn fields survive the file and a resume recomputes nothing.
    before = (out / "records.jsonl").read_text()
    assert main(argv) == 0
    assert (out / "records.jsonl").read_text() == before
    assert "multiturn" in (out / "table.md").read_text()
    assert "## Per turn: multiturn at budget 1024" in (out / "table.md").read_text()
    assert (out / "turns_multiturn_1024.png").stat().st_size > 0


@pytest.mark.parametrize(("given", "methods"), [
    ("dense,oracle", ["dense", "oracle"]),
    ("dense;oracle", ["dense", "oracle"]),  # ';' without knobs: still a list
    ("dense;nexus:sampler=topk,lam=0", ["dense", "nexus:sampler=topk,lam=0"]),
    ("nexus:sampler=topk,lam=0", ["nexus:sampler=topk,lam=0"]),
])
def test_method_lists_split_on_the_separator_given(given: str, methods: list[str]) -> None:
    from nexus_vllm.eval.cli import _merge, build_parser, run_config

    cfg = run_config(_merge(build_parser().parse_args(["--methods", given])))
    assert list(cfg.methods) == methods
