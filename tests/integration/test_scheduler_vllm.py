"""``NexusScheduler`` built as vLLM builds it (real config, KV-cache manager and requests;
no model runs): a lone evicting request's prefill is chunked, the step's stats carry the
eviction stats, and ``NEXUS_VLLM_FAULTS`` swaps in the fault doubles while the
production parts carry no fault check.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import pytest

from tests.integration.conftest import HAS_VLLM

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

SCHEDULER_DIR = (pathlib.Path(__file__).resolve().parents[2]
                 / "nexus_vllm" / "integration" / "scheduler")
CHUNK = 128
BLOCK = 32


def _scheduler(model: str, **nexus: Any) -> Any:
    """A ``NexusScheduler`` for ``model`` with ``additional_config['nexus']`` = ``nexus``."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    import nexus_vllm

    nexus_vllm.register()
    config = EngineArgs(model=model, block_size=BLOCK, max_model_len=2048,
                        enable_prefix_caching=False,
                        additional_config={"nexus": {"method": "nexus", **nexus}}
                        ).create_engine_config()
    config.cache_config.num_gpu_blocks = 200  # what the engine core sets after profiling
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32,
                             dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=200, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    cls = config.scheduler_config.get_scheduler_cls()
    assert cls.__name__ == "NexusScheduler"
    return cls(vllm_config=config, kv_cache_config=kv, block_size=BLOCK, log_stats=True,
               structured_output_manager=StructuredOutputManager(config))


def _request(req_id: str, prompt: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, list(range(1, prompt + 1)), SamplingParams(max_tokens=8), None)


@pytest.mark.parametrize("mode, lone", [("stream", CHUNK), ("end", 700)])
def test_a_lone_evicting_request_prefills_in_chunks(tiny_model, mode, lone) -> None:  # noqa: ANN001
    """vLLM lifts its per-request prefill cap for a lone request; a server that evicts
    mid-prompt (``stream``) keeps it (``lone_request_prefill_cap``), one that does not
    (``end``) leaves the chunking to vLLM."""
    sched = _scheduler(tiny_model, max_tokens=256, prompt_mode=mode, chunk_size=CHUNK)
    budget = sched.max_num_scheduled_tokens
    sched.add_request(_request("a", 700))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": lone}
    assert sched.max_num_scheduled_tokens == budget  # only for the call
    # Two requests: vLLM's own cap, for both modes.
    sched = _scheduler(tiny_model, max_tokens=256, prompt_mode=mode, chunk_size=CHUNK)
    sched.add_request(_request("a", 700))
    sched.add_request(_request("b", 700))
    cap = CHUNK if mode == "stream" else None
    assert all(n == (cap or n) for n in sched.schedule().num_scheduled_tokens.values())


def test_step_stats_carry_the_eviction_stats(tiny_model) -> None:  # noqa: ANN001
    from nexus_vllm.integration.metrics import take_stats

    sched = _scheduler(tiny_model, max_tokens=256, prompt_mode="stream", chunk_size=CHUNK)
    sched.add_request(_request("a", 300))
    sched.schedule()
    stats = sched.make_stats()
    assert not any(str(k).startswith("nexus") for k in stats.num_kv_fetch_reqs_by_stage)
    update = take_stats(stats)
    assert update is not None and stats.kv_connector_stats is None
    assert update.gauges["total_blocks"] == 199 and update.gauges["live_blocks"] == 4
    assert update.gauges["plans_in_flight"] == 1 and update.counters["policy_us"] >= 0


def test_faults_swap_in_the_doubles(tiny_model, monkeypatch) -> None:  # noqa: ANN001
    from nexus_vllm.integration import faults
    from nexus_vllm.integration.scheduler.evictor import Evictor
    from nexus_vllm.integration.scheduler.manager import PlanSender
    from nexus_vllm.integration.testing.scheduler_doubles import (
        DuplicatingSender,
        FailingEvictor,
    )

    sched = _scheduler(tiny_model, max_tokens=256)
    assert type(sched.nexus_manager.evictor) is Evictor
    assert type(sched._nexus_sender) is PlanSender
    monkeypatch.setenv(faults.ENV, "plan_duplicate/3,policy_error,score_error@1")
    sched = _scheduler(tiny_model, max_tokens=256)
    assert type(sched.nexus_manager.evictor) is FailingEvictor
    assert type(sched._nexus_sender) is DuplicatingSender


def test_production_parts_ask_no_fault() -> None:
    """No production module of the scheduler or the worker asks whether a fault fires
    (only the doubles do, ``fires`` bound by ``faults.with_doubles``); each process's
    parts pass ``faults.with_doubles`` once, where they are built."""
    callers: dict[str, set[str]] = {"fires": set(), "with_doubles": set()}
    for path in [*SCHEDULER_DIR.glob("*.py"), *(SCHEDULER_DIR.parent / "worker").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in callers:
                callers[node.attr].add(f"{path.parent.name}/{path.name}")
    assert callers == {"fires": set(),
                       "with_doubles": {"scheduler/scheduler.py", "worker/worker.py"}}
