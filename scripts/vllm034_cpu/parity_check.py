"""Serve the embedded SmolLM2 with two vLLM builds and compare their outputs (test-only
vLLM 0.34 build of ``scripts/setup_vllm034.sh``; not product code).

    .venv/bin/python scripts/vllm034_cpu/parity_check.py            # .venv vs .venv-vllm034
    ... parity_check.py --python A/bin/python --python B/bin/python [--workdir DIR]
    ... parity_check.py --url http://127.0.0.1:8765                 # query a running server

Each server runs alone (``vllm serve`` on 127.0.0.1, the CPU flags of the e2e fixtures,
chunked prefill at 256 tokens), answers a fixed set of requests, and is stopped. Then:
greedy completions (single, batched, concurrent, chat, a ~1.1k-token prompt prefilled in
chunks, logit bias + min_tokens) must be token-identical; prompt logprobs must agree to
1e-3; seeded sampling must repeat itself within a build (its noise differs between 0.32 and
0.34 by design). Exit status 0 when all hold. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL_NAME = "smol"
CPU_FLAGS = ["--enforce-eager", "--dtype", "float32", "--distributed-executor-backend", "uni",
             "--max-model-len", "2048", "--max-num-seqs", "32",
             "--max-num-batched-tokens", "256", "--served-model-name", MODEL_NAME]
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,"]
LONG_PROMPT = ("The city of Veltra sits on a river. Its bakers rise at four and its ferrymen "
               "count the tides. " * 50) + "\nQuestion: what do the bakers of Veltra do?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, path: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return {"error": exc.code, "body": exc.read().decode(errors="replace")[:2000]}


def _completion(url: str, prompt: Any, **kw: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0.0,
            "return_token_ids": True, **kw}
    return _post(url, "/v1/completions", body)


def _ids(resp: dict[str, Any]) -> list[list[int]] | dict[str, Any]:
    if "choices" not in resp:
        return resp
    return [c.get("token_ids") for c in sorted(resp["choices"], key=lambda c: c["index"])]


def run_requests(url: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    for i, p in enumerate(PROMPTS):
        out[f"greedy_{i}"] = _ids(_completion(url, p))
    out["greedy_batch"] = _ids(_completion(url, PROMPTS))
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(_completion, url, p) for p in [*PROMPTS, "Water boils at"]]
        out["concurrent_4"] = [_ids(f.result()) for f in futs]
    chat = _post(url, "/v1/chat/completions", {
        "model": MODEL_NAME, "max_tokens": 16, "temperature": 0.0, "return_token_ids": True,
        "messages": [{"role": "user", "content": "Name three colours."}]})
    out["chat_greedy"] = ([chat["choices"][0].get("token_ids"),
                           chat["choices"][0]["message"]["content"]]
                          if "choices" in chat else chat)
    long = _completion(url, LONG_PROMPT)
    out["long_prompt"] = _ids(long)
    out["long_prompt_tokens"] = long.get("usage", {}).get("prompt_tokens")
    out["logit_bias_min_tokens"] = _ids(_completion(
        url, PROMPTS[0], logit_bias={"7042": -100.0, "30": 5.0}, min_tokens=8))
    plp = _completion(url, PROMPTS[1], max_tokens=2, prompt_logprobs=1)
    out["prompt_logprobs"] = (
        [None if d is None else {k: v["logprob"] for k, v in d.items()}
         for d in plp["choices"][0]["prompt_logprobs"]] if "choices" in plp else plp)
    seeded = dict(temperature=0.8, top_p=0.95, seed=1234)
    out["seeded_a"] = _ids(_completion(url, PROMPTS[2], **seeded))
    out["seeded_b"] = _ids(_completion(url, PROMPTS[2], **seeded))
    out["seeded_t1_a"] = _ids(_completion(url, PROMPTS[2], temperature=1.0, seed=7))
    out["seeded_t1_b"] = _ids(_completion(url, PROMPTS[2], temperature=1.0, seed=7))
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def serve_and_run(python: str, workdir: pathlib.Path, tag: str) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from nexus_vllm.models import default_model_path  # noqa: PLC0415

    model = str(default_model_path())
    port = _free_port()
    log = workdir / f"serve_{tag}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_CACHE_ROOT": str(workdir / f"cache_{tag}")}
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), *CPU_FLAGS]
    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{tag}: server exited {proc.returncode}; see {log}")
            if time.monotonic() - t0 > 400:
                raise TimeoutError(f"{tag}: server not ready in 400 s; see {log}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        startup = time.monotonic() - t0
        result = run_requests(url)
        result["startup_seconds"] = round(startup, 1)
        result["python"] = python
        return result
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


EXACT = ["greedy_0", "greedy_1", "greedy_2", "greedy_batch", "concurrent_4", "chat_greedy",
         "long_prompt", "logit_bias_min_tokens"]


def compare(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ok = True
    for key in EXACT:
        same = a.get(key) == b.get(key)
        ok &= same
        print(f"  {key:24s} {'equal' if same else 'DIFFERENT'}"
              + ("" if same else f"\n    A={a.get(key)}\n    B={b.get(key)}"))
    pa, pb = a.get("prompt_logprobs"), b.get("prompt_logprobs")
    if isinstance(pa, list) and isinstance(pb, list) and len(pa) == len(pb):
        diffs = [abs(x[k] - y[k]) for x, y in zip(pa, pb) if x and y for k in x if k in y]
        same_keys = all((x or {}).keys() == (y or {}).keys() for x, y in zip(pa, pb))
        close = same_keys and bool(diffs) and max(diffs) < 1e-3
        print(f"  {'prompt_logprobs':24s} {'close' if close else 'DIFFERENT'} "
              f"(max |diff| {max(diffs) if diffs else None}, same token ids {same_keys})")
    else:
        close = False
        print(f"  prompt_logprobs          DIFFERENT\n    A={pa}\n    B={pb}")
    ok &= close
    for tag, r in (("A", a), ("B", b)):
        for name in ("seeded", "seeded_t1"):
            rep = r.get(f"{name}_a") == r.get(f"{name}_b") and isinstance(r.get(f"{name}_a"), list)
            ok &= rep
            print(f"  {tag} {name:22s} {'repeats' if rep else 'DOES NOT REPEAT'}: "
                  f"{r.get(f'{name}_a')}")
    print(f"  long prompt: {a.get('long_prompt_tokens')} tokens; startup A "
          f"{a.get('startup_seconds')} s, B {b.get('startup_seconds')} s; requests A "
          f"{a.get('seconds')} s, B {b.get('seconds')} s")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", action="append", help="interpreter of a build (twice)")
    ap.add_argument("--url", help="only run the requests against this server and print them")
    ap.add_argument("--workdir", default="/tmp/nexus_vllm034_parity")
    args = ap.parse_args()
    if args.url:
        print(json.dumps(run_requests(args.url.rstrip("/")), indent=1))
        return 0
    pythons = args.python or [str(REPO / ".venv/bin/python"),
                              str(REPO / ".venv-vllm034/bin/python")]
    if len(pythons) != 2:
        ap.error("give --python twice")
    work = pathlib.Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for tag, py in zip("AB", pythons):
        print(f"[parity] {tag}: serving with {py} ...", flush=True)
        results.append(serve_and_run(py, work, tag))
        (work / f"result_{tag}.json").write_text(json.dumps(results[-1], indent=1))
    print(f"[parity] A={pythons[0]}\n[parity] B={pythons[1]}")
    ok = compare(*results)
    print(f"[parity] {'PASS' if ok else 'FAIL'} (results and logs in {work})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
