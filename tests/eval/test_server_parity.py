"""``nexus-vllm parity`` against a stand-in server (no vLLM): the request it sends, the
token-id comparison, the evicted-block counts and the exit code. The real server is
compared in tests/integration/test_e2e_smollm2.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from nexus_vllm.cli import main as cli_main
from nexus_vllm.core import EvictionConfig
from nexus_vllm.hf import generate_ids
from nexus_vllm.hf.testing import save_tiny_checkpoint

torch.set_num_threads(1)

# The stand-in server's eviction config (what a server started with these flags runs).
SERVER_KNOBS = {"block_size": 8, "chunk_size": 64, "seed": 3}
SERVER_BUDGET = 256  # its --kv-budget, for requests that send none
FLAGS = ["--block-size", "8", "--chunk-size", "64", "--eviction-seed", "3"]


class _Server:
    """Answers /v1/models, /metrics and greedy /v1/completions with the transformers path,
    as the plugin would; ``corrupt`` flips the last generated token."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(path)
        self.evicted = 0
        self.corrupt = False
        self.requests: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, body: str, kind: str = "application/json") -> None:
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/v1/models":
                    self._send(json.dumps({"data": [{"id": "tiny"}]}))
                else:
                    # As vLLM's exporter: the plugin's series appear once a request has
                    # run, a labelled counter at its first increment.
                    text = ""
                    if owner.requests:
                        text += "vllm:nexus_free_blocks{model_name=\"tiny\"} 100.0\n"
                    if owner.evicted:
                        text += ("# TYPE vllm:nexus_evicted_blocks_total counter\n"
                                 f"vllm:nexus_evicted_blocks_total{{model_name=\"tiny\"}} "
                                 f"{float(owner.evicted)}\n")
                    self._send(text, "text/plain")

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/chat/completions":
                    self._send(json.dumps(owner.chat(body)))
                else:
                    self._send(json.dumps(owner.complete(body)))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(body)
        xargs = body["vllm_xargs"]
        cfg = None if xargs["kv_eviction"] == "none" else EvictionConfig.from_budget(
            xargs["kv_eviction"], xargs.get("kv_budget", SERVER_BUDGET), **SERVER_KNOBS)
        prompt = body["prompt"]
        if isinstance(prompt, str):  # text, tokenized as vLLM's completions endpoint does
            prompt = list(self.tok(prompt)["input_ids"])
        ids, session = generate_ids(self.model, prompt, cfg,
                                    max_new_tokens=body["max_tokens"],
                                    eos_token_ids={self.tok.eos_token_id})
        self.evicted += sum(e.blocks_before - e.blocks_after for e in session.events)
        if self.corrupt:
            ids = [*ids[:-1], (ids[-1] + 1) % len(self.tok)]
        return {"choices": [{"text": self.tok.decode(ids, skip_special_tokens=True),
                             "token_ids": ids}]}

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """As vLLM's chat endpoint: render the template, tokenize without special tokens,
        complete; the prompt ids come back with the answer."""
        text = self.tok.apply_chat_template(body["messages"], tokenize=False,
                                            add_generation_prompt=True)
        prompt = list(self.tok(text, add_special_tokens=False)["input_ids"])
        out = self.complete({**body, "prompt": prompt})
        choice = out["choices"][0]
        return {"prompt_token_ids": prompt,
                "choices": [{"message": {"role": "assistant", "content": choice["text"]},
                             "token_ids": choice["token_ids"]}]}

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tokenizer="byte")
    s = _Server(str(path))
    yield s, str(path)
    s.stop()


def _run(capsys, server, *flags: str) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    s, path = server
    rc = cli_main(["parity", "--base-url", s.base_url, "--model", path, "--task", "passkey",
                   "--context", "400", "--samples", "2", *flags])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    return rc, lines[:-1], lines[-1]["summary"]


def test_parity_with_eviction_compares_ids_and_evicted_blocks(server, capsys) -> None:
    s, _ = server
    rc, rows, summary = _run(capsys, server, "--method", "nexus", "--budget", "96", *FLAGS)
    assert rc == 0 and len(rows) == 2
    assert s.requests[-1]["vllm_xargs"] == {"kv_eviction": "nexus", "kv_budget": 96}
    assert s.requests[-1]["temperature"] == 0.0 and s.requests[-1]["return_token_ids"]
    for r in rows:
        assert r["ids_match"] and r["first_difference"] is None
        assert r["server_text"] == r["hf_text"]
        assert r["server_evicted_blocks"] == r["hf_evicted_blocks"] > 0
    assert summary["ids_match"] == summary["evicted_match"] == 2 and summary["budget"] == 96


def test_parity_reports_a_difference_and_fails(server, capsys) -> None:
    s, _ = server
    s.corrupt = True
    try:
        rc, rows, summary = _run(capsys, server, "--method", "none")
    finally:
        s.corrupt = False
    assert rc == 1 and summary["ids_match"] == 0
    assert s.requests[-1]["vllm_xargs"] == {"kv_eviction": "none"}
    for r in rows:
        assert r["ids_match"] is False and r["first_difference"] is not None
        assert r["server_evicted_blocks"] == r["hf_evicted_blocks"] == 0


def test_a_different_server_config_shows_up(server, capsys) -> None:
    # Told the wrong block size, the HF side evicts other blocks than the server.
    rc, rows, _ = _run(capsys, server, "--method", "nexus", "--budget", "96",
                       "--block-size", "16", "--chunk-size", "64", "--eviction-seed", "3")
    assert any(r["server_evicted_blocks"] != r["hf_evicted_blocks"] or not r["ids_match"]
               for r in rows)


def test_multiturn_sends_every_turn_as_a_request(server, capsys) -> None:
    s, path = server
    n = len(s.requests)
    rc = cli_main(["parity", "--base-url", s.base_url, "--model", path, "--task", "multiturn",
                   "--context", "7000", "--samples", "1", "--method", "nexus", "--budget",
                   "512", *FLAGS])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    rows = lines[:-1]
    assert rc == 0 and [r["turn"] for r in rows] == list(range(6))
    sent = s.requests[n:]
    # Each turn's prompt extends the previous one: the conversation so far.
    assert all(b["prompt"][:len(a["prompt"])] == a["prompt"] for a, b in zip(sent, sent[1:]))
    assert all(r["ids_match"] and r["server_evicted_blocks"] == r["hf_evicted_blocks"] > 0
               for r in rows)


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    """The stand-in with a chat template (the trained test tokenizer's)."""
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_chat"), tokenizer="trained")
    s = _Server(str(path))
    yield s, str(path)
    s.stop()


@pytest.mark.parametrize("task, context, turns", [("niah_single_prose", 1500, None),
                                                  ("chat_multiturn", 4000, list(range(6)))])
def test_chat_protocol_sends_messages_and_checks_the_server_prompt(chat_server, capsys, task,
                                                                   context, turns) -> None:
    """``--protocol chat``: each request goes to /v1/chat/completions as messages; the
    server's rendering of them is the suite's own prompt, and the answer's ids match."""
    s, path = chat_server
    n = len(s.requests)
    rc = cli_main(["parity", "--base-url", s.base_url, "--model", path, "--task", task,
                   "--protocol", "chat", "--context", str(context), "--samples", "1",
                   "--method", "nexus", "--budget", "256", *FLAGS])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    rows = lines[:-1]
    assert rc == 0, rows
    assert [r["turn"] for r in rows] == (turns or [None])
    assert all(r["prompt_match"] and r["ids_match"] for r in rows), rows
    sent = s.requests[n:]
    assert all(b["messages"][-1]["role"] == "user" for b in sent)
    assert all(b["messages"][-1]["content"].rstrip().endswith("?") for b in sent)


def test_server_eval_scores_the_chat_suite_and_resumes(chat_server, tmp_path) -> None:
    """``nexus-vllm server-eval``: every (sample, method) is one chat request with the
    method in ``vllm_xargs``; dense runs first and is the reference of ``summary``; the
    records resume."""
    from nexus_vllm.eval.records import read_records

    s, path = chat_server
    out = tmp_path / "server_eval"
    argv = ["server-eval", "--base-url", s.base_url, "--model", path, "--budget", "256",
            "--tasks", "niah_single_prose,summary", "--methods", "nexus;tova;dense",
            "--samples", "1", "--context", "1500", "--data-seed", "0", "--out", str(out),
            "--no-progress"]
    n = len(s.requests)
    assert cli_main(argv) == 0
    sent = s.requests[n:]
    assert [b["vllm_xargs"]["kv_eviction"] for b in sent] == ["none", "nexus", "tova"] * 2
    records = read_records(out / "records.jsonl")
    assert [(r.task, r.method) for r in records] == [
        (t, m) for t in ("niah_single_prose", "summary") for m in ("dense", "nexus", "tova")]
    summary = {r.method: r for r in records if r.task == "summary"}
    assert summary["dense"].score == 1.0 and summary["dense"].budget is None
    assert summary["nexus"].budget == 256 and summary["nexus"].answers == ()
    assert all(r.protocol == "chat" for r in records)
    assert (out / "table.md").exists() and (out / "config.yaml").exists()
    assert cli_main(argv) == 0 and len(s.requests) == n + 6  # resumed: nothing re-sent


def test_server_eval_sends_completion_prompts_for_base_models(chat_server, tmp_path) -> None:
    """``--protocol question-last``: each sample's prompt text goes to /v1/completions
    (a base model has no chat template), scored like the transformers path's."""
    from transformers import AutoTokenizer

    from nexus_vllm.eval.records import read_records
    from nexus_vllm.eval.tasks import make_sample

    s, path = chat_server
    out = tmp_path / "server_eval_completion"
    n = len(s.requests)
    assert cli_main(["server-eval", "--base-url", s.base_url, "--model", path, "--budget",
                     "256", "--tasks", "passkey", "--methods", "dense,nexus", "--samples",
                     "1", "--context", "1200", "--data-seed", "0", "--protocol",
                     "question-last", "--out", str(out), "--no-progress"]) == 0
    sent = s.requests[n:]
    want = make_sample("passkey", seed=0, index=0, target_tokens=1200,
                       tokenizer=AutoTokenizer.from_pretrained(path),
                       protocol="question-last")
    assert [b.get("prompt") for b in sent] == [want.preamble + want.context
                                               + want.question] * 2
    assert all("messages" not in b for b in sent)
    records = read_records(out / "records.jsonl")
    assert [(r.protocol, r.method) for r in records] == [("question-last", "dense"),
                                                         ("question-last", "nexus")]


@pytest.mark.parametrize("flags, match", [
    (["--task", "longgen"], "cannot be sent to a server"),
    (["--protocol", "dialogue"], "--protocol must be one of"),
    (["--task", "chat_multiturn"], "give --protocol chat"),
    (["--budget", "lots"], "budget must be a keep ratio"),
    (["--budget", "1.5"], "ratio must be in"),
    (["--knobs", "[1]"], "JSON object"),
    (["--knobs", '{"lamda": 1}'], "did you mean 'lam'"),
    (["--samples", "0"], "--samples"),
])
def test_bad_flags_are_refused_before_any_request(flags, match, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["parity", "--base-url", "http://127.0.0.1:9", *flags])
    assert exc.value.code == 2 and match in capsys.readouterr().err
