"""The one ``/metrics`` parser (nexus_vllm.eval.metrics_text): labels kept, names as the
exporter prints them, every label set of a series counted."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nexus_vllm.eval.metrics_text import Metrics, Sample, parse_metrics

# What vLLM's API server prints for the plugin's series (prometheus_client's text format),
# trimmed: a counter split by kind, a gauge per engine, a histogram by prompt_mode, and
# one of vLLM's own series with two labels.
TEXT = r"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="SmolLM2-135M-Instruct"} 3.0
# HELP vllm:nexus_free_blocks Free blocks in the KV block pool.
# TYPE vllm:nexus_free_blocks gauge
vllm:nexus_free_blocks{engine="0"} 120.0
vllm:nexus_free_blocks{engine="1"} 80.0
# HELP vllm:nexus_faults_total Eviction faults absorbed, by kind.
# TYPE vllm:nexus_faults_total counter
vllm:nexus_faults_total{engine="0",kind="plan_lost"} 7.0
vllm:nexus_faults_total{engine="0",kind="score_error"} 5.0
vllm:nexus_faults_total{engine="1",kind="plan_lost"} 2.0
vllm:nexus_faults_total{engine="0",kind="policy_error"} 3.0
# HELP vllm:nexus_faults_created Eviction faults absorbed, by kind.
# TYPE vllm:nexus_faults_created gauge
vllm:nexus_faults_created{engine="0",kind="plan_lost"} 1.7e+09
vllm:nexus_faults_created{engine="0",kind="score_error"} 1.7e+09
# HELP vllm:nexus_request_peak_live_blocks Peak live KV blocks of each finished evicting request.
# TYPE vllm:nexus_request_peak_live_blocks histogram
vllm:nexus_request_peak_live_blocks_bucket{engine="0",le="8.0",prompt_mode="stream"} 1.0
vllm:nexus_request_peak_live_blocks_bucket{engine="0",le="16.0",prompt_mode="stream"} 4.0
vllm:nexus_request_peak_live_blocks_bucket{engine="0",le="+Inf",prompt_mode="stream"} 4.0
vllm:nexus_request_peak_live_blocks_count{engine="0",prompt_mode="stream"} 4.0
vllm:nexus_request_peak_live_blocks_sum{engine="0",prompt_mode="stream"} 50.0
vllm:nexus_request_peak_live_blocks_bucket{engine="0",le="8.0",prompt_mode="end"} 0.0
vllm:nexus_request_peak_live_blocks_bucket{engine="0",le="16.0",prompt_mode="end"} 0.0
vllm:nexus_request_peak_live_blocks_bucket{engine="0",le="+Inf",prompt_mode="end"} 2.0
vllm:nexus_request_peak_live_blocks_count{engine="0",prompt_mode="end"} 2.0
vllm:nexus_request_peak_live_blocks_sum{engine="0",prompt_mode="end"} 128.0
"""
FAULTS = "vllm:nexus_faults_total"
PEAK = "vllm:nexus_request_peak_live_blocks"


def test_every_label_set_counts() -> None:
    """The bug of the old hand-written parsers: the first sample of a series stood for
    all of it (7 plan_lost faults of engine 0 read as the server's 17 faults)."""
    m = parse_metrics(TEXT)
    assert m[FAULTS] == 17.0
    assert m.by_label(FAULTS, "kind") == {"plan_lost": 9.0, "score_error": 5.0,
                                          "policy_error": 3.0}
    assert m.by_label(FAULTS, "kind", engine="1") == {"plan_lost": 2.0}
    assert m.total(FAULTS, kind="plan_lost") == 9.0
    assert m.total(FAULTS, kind="plan_lost", engine=0) == 7.0  # label values compare as text
    assert m["vllm:nexus_free_blocks"] == 200.0
    assert m.total("vllm:nexus_free_blocks", engine="1") == 80.0
    assert m.by_label("vllm:nexus_free_blocks", "engine") == {"0": 120.0, "1": 80.0}


def test_labels_and_order_are_kept() -> None:
    m = parse_metrics(TEXT)
    assert m.samples("vllm:num_requests_running") == [
        Sample({"engine": "0", "model_name": "SmolLM2-135M-Instruct"}, 3.0)]
    assert [s.labels["kind"] for s in m.samples(FAULTS, engine="0")] == [
        "plan_lost", "score_error", "policy_error"]


def test_counter_and_histogram_sample_names() -> None:
    """Samples go by the names the exporter prints: a counter's ``_total`` (its
    ``_created`` start times apart), a histogram's ``_bucket`` / ``_count`` / ``_sum``;
    the family names (without the suffixes) hold no samples."""
    m = parse_metrics(TEXT)
    assert "vllm:nexus_faults" not in m and PEAK not in m
    assert m.total("vllm:nexus_faults_created", kind="plan_lost") == 1.7e9
    assert m.by_label(f"{PEAK}_count", "prompt_mode") == {"stream": 4.0, "end": 2.0}
    assert m.by_label(f"{PEAK}_sum", "prompt_mode") == {"stream": 50.0, "end": 128.0}
    # Buckets are cumulative, one per ``le`` bound.
    assert m.by_label(f"{PEAK}_bucket", "le", prompt_mode="stream") == {
        "8.0": 1.0, "16.0": 4.0, "+Inf": 4.0}
    assert m.total(f"{PEAK}_bucket", le="+Inf") == m[f"{PEAK}_count"] == 6.0


def test_what_the_exporter_writes() -> None:
    """Text from prometheus_client itself, with the plugin's metric names (the exporter
    is given ``vllm:nexus_faults``; it prints ``vllm:nexus_faults_total``)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    faults = Counter("vllm:nexus_faults", "Faults.", ["engine", "kind"], registry=registry)
    faults.labels("0", "plan_lost").inc(3)
    faults.labels("0", "plan_stale").inc(4)
    Gauge("vllm:nexus_live_blocks", "Live.", ["engine"], registry=registry).labels("0").set(12)
    peaks = Histogram(PEAK, "Peaks.", ["engine", "prompt_mode"], buckets=(16, float("inf")),
                      registry=registry)
    for blocks in (10, 20):
        peaks.labels("0", "keep").observe(blocks)
    m = parse_metrics(generate_latest(registry).decode())
    assert m.by_label(FAULTS, "kind") == {"plan_lost": 3.0, "plan_stale": 4.0}
    assert m["vllm:nexus_live_blocks"] == 12.0
    assert m.by_label(f"{PEAK}_bucket", "le") == {"16.0": 1.0, "+Inf": 2.0}
    assert (m[f"{PEAK}_sum"], m[f"{PEAK}_count"]) == (30.0, 2.0)


def test_mapping_and_absent_series() -> None:
    m = parse_metrics(TEXT)
    assert isinstance(m, Metrics) and len(m) == 7
    assert set(m) == {"vllm:num_requests_running", "vllm:nexus_free_blocks", FAULTS,
                      "vllm:nexus_faults_created", f"{PEAK}_bucket", f"{PEAK}_count",
                      f"{PEAK}_sum"}
    assert m.get("vllm:nexus_evicted_blocks_total") is None  # absent until first use
    assert m.total("vllm:nexus_evicted_blocks_total") == 0.0
    assert m.samples("vllm:nexus_evicted_blocks_total") == []
    assert m.total(FAULTS, kind="no_such_kind") == 0.0 and FAULTS in m
    with pytest.raises(KeyError):
        m["vllm:nexus_evicted_blocks_total"]
    assert parse_metrics("") == {} and len(parse_metrics("# only a comment\n")) == 0
    # Untyped lines without HELP/TYPE parse too (a stand-in server prints those).
    assert parse_metrics('vllm:x{a="1"} 2\nvllm:x{a="2"} 3\n').by_label("vllm:x", "a") == {
        "1": 2.0, "2": 3.0}


def test_bad_text_and_empty_series_are_refused() -> None:
    with pytest.raises(ValueError):
        parse_metrics("vllm:nexus_free_blocks{engine=0} 1\n")  # unquoted label value
    with pytest.raises(ValueError, match="without samples"):
        Metrics({"vllm:x": ()})


def test_read_metrics_over_http() -> None:
    """``read_metrics`` (what ``VllmServer.metrics`` and the scripts call) reads every
    ``kind`` of the faults counter, not the first line's."""
    from nexus_vllm.eval.server import read_metrics

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = TEXT.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        m = read_metrics(f"http://127.0.0.1:{httpd.server_address[1]}/")
    finally:
        httpd.shutdown()
        thread.join()
    assert m[FAULTS] == 17.0 and m.by_label(FAULTS, "kind")["score_error"] == 5.0
