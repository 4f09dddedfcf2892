"""Every request's blocks in vLLM's pool stay within ``budget.bound_blocks``, for
prompts of every length modulo the block size, in every prompt mode.

A fake engine loop drives vLLM's real scheduler (``NexusScheduler`` over vLLM 0.32's
``Scheduler``, and ``NexusAsyncScheduler`` over its ``AsyncScheduler`` with two steps in
flight, in the order of ``EngineCore.step_with_batch_queue``), with no model: the runner's
output is a token for every request that samples and random evidence for every request
the plan scores. So vLLM's own code decides the chunks, allocates the blocks (a decode
token's block included) and admits the requests. After every ``schedule()`` the test
counts each request's blocks in vLLM's block lists (not the plugin's live index or
gauges): vLLM allocates only there and eviction only frees, so the largest count is the
most the request ever held. Each must be at most the bound admission reserved for it, and
the pool's used blocks must be the requests' blocks. The plugin's own pool self-check
(``AdmissionGate.check_pool``) must read the same peaks.

Prompts: ``base + r`` tokens for every residue ``r`` of the block size, above the budget
(events fire in the prompt or at its end) and below it (only decoding crosses the
budget), with answers of 1 token, one that crosses a block boundary, and ones long enough
for decode events; all in flight at once, so vLLM chunks the prompts by its step budget.
Then the same prompts preempted after a block of answer (vLLM's own preemption): a
resumed request recomputes its prompt and its answer as one prefill, and its bound
(``bound_blocks(..., recompute_tokens=...)``) covers that.
"""

from __future__ import annotations

import json
import pathlib
from collections import deque
from typing import Any

import numpy as np
import pytest
import torch

from nexus_vllm.core.budget import bound_blocks
from tests.integration.conftest import HAS_VLLM
from tests.integration.fakes import live_indices

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

BLOCK = 16
BUDGET = 128  # 8 blocks
CHUNK = 64  # where the server caps prompt chunks (modes that evict mid-prompt)
STEP_TOKENS = 512  # vLLM's step budget: the chunk of modes that do not
LONG, SHORT = 10 * BLOCK, 3 * BLOCK  # prompt bases: above and below the budget
# (prompt base, answer lengths): a 1-token answer (the prompt's peak alone), one that
# crosses one block boundary, and ones with decode events (interval 16).
WORKLOAD = {LONG: (1, BLOCK + 1, 3 * BLOCK), SHORT: (BLOCK + 1, BUDGET + 2 * BLOCK)}
# Server settings per prompt mode: (EvictionConfig fields, the server's prefill cap or 0).
MODES = {
    "stream": ({"prompt_mode": "stream"}, CHUNK),
    "end": ({"prompt_mode": "end"}, 0),
    "end-prefill-budget": ({"prompt_mode": "end", "prefill_budget": 2 * BUDGET}, CHUNK),
    "keep": ({"prompt_mode": "keep"}, 0),
}
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
              "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
              "torch_dtype": "float32", "rms_norm_eps": 1e-5}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A config vLLM reads the model's shape from (the scheduler runs no model)."""
    path = tmp_path_factory.mktemp("bound_residues")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


def make_scheduler(model_dir: pathlib.Path, mode: str, *, async_scheduling: bool,
                   num_blocks: int = 2048) -> Any:
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from nexus_vllm.core import EvictionConfig
    from nexus_vllm.integration.scheduler.scheduler import NexusAsyncScheduler, NexusScheduler

    flags, cap = MODES[mode]
    cfg = EvictionConfig(method="nexus", max_tokens=BUDGET, chunk_size=cap or STEP_TOKENS,
                         block_size=BLOCK, seed=3, **flags)
    max_len = 1024
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                        max_model_len=max_len)
    sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=STEP_TOKENS,
                            max_model_len=max_len, enable_chunked_prefill=True,
                            long_prefill_token_threshold=cap, is_encoder_decoder=False,
                            async_scheduling=async_scheduling)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    vllm_config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                             additional_config={"nexus": cfg.to_dict()})
    # The CPU platform turns async scheduling off; its scheduler runs without a model.
    sched.async_scheduling = async_scheduling
    cache.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32,
                             dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    cls = NexusAsyncScheduler if async_scheduling else NexusScheduler
    return cls(vllm_config=vllm_config, kv_cache_config=kv,
               structured_output_manager=StructuredOutputManager(vllm_config),
               block_size=BLOCK, log_stats=False)  # counters not drained


class PoolLoop:
    """vLLM's engine core reduced to its batch queue (``step_with_batch_queue``) over a
    real scheduler, reading vLLM's block lists after every ``schedule()``."""

    def __init__(self, scheduler: Any) -> None:
        self.sched = scheduler
        self.k = int(scheduler.nexus_manager.steps_in_flight)
        from nexus_vllm.integration.testing.pool_watch import PoolWatch

        # vLLM's pool read after every schedule(), and the plugin's self-check (PoolPeaks).
        self.watch = PoolWatch(scheduler, check=True).wrap()
        self.pool = self.watch.pool
        self.queue: deque[tuple[Any, Any]] = deque()
        self.prompts: dict[str, int] = {}
        self.rng = np.random.default_rng(0)
        self.steps = 0

    def add(self, req_id: str, prompt: int, answer: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        ids = [(7 + 31 * i) % 1000 for i in range(prompt)]
        self.sched.add_request(Request(req_id, ids, SamplingParams(
            max_tokens=answer, ignore_eos=True), None))
        self.prompts[req_id] = prompt

    def run(self, max_steps: int = 20000, until: Any = None) -> None:
        """Run to the end, or until ``until()`` holds between two steps."""
        while self.sched.has_requests() or self.queue:
            if until is not None and until():
                return
            self.steps += 1
            assert self.steps < max_steps, "the engine made no progress"
            if self.sched.has_requests() and len(self.queue) < self.k:
                out = self.sched.schedule()
                # Prefix caching is off: every block in use is some request's.
                assert not self.watch.mismatches, self.watch.mismatches
                self.queue.appendleft((out, self.runner_output(out)))
                if out.total_num_scheduled_tokens > 0 and len(self.queue) < self.k:
                    continue
            if self.queue:
                out, runner_output = self.queue.pop()
                self.sched.update_from_output(out, runner_output)

    def preempt_all(self) -> None:
        """vLLM's preemption of every running request (its blocks freed, back to the
        waiting queue, resumed by recomputing its prompt and what it generated)."""
        for request in list(self.sched.running):
            self.sched.running.remove(request)
            self.sched._preempt_request(request, 0.0)

    @property
    def peaks(self) -> dict[str, int]:
        """The most blocks each request held in vLLM's pool."""
        return {r: row.peak for r, row in self.watch.rows.items()}

    @property
    def bounds(self) -> dict[str, int]:
        """The bound admission reserved for each request (its largest)."""
        return {r: row.bound for r, row in self.watch.rows.items()}

    @property
    def check_peaks(self) -> dict[str, int]:
        return self.watch.check_peaks

    def runner_output(self, out: Any) -> Any:
        """A token for every request whose step ends its prompt (vLLM's runner samples
        there), evidence over its live blocks for every request the plan scores."""
        from vllm.v1.outputs import ModelRunnerOutput

        from nexus_vllm.core import evidence_kind
        from nexus_vllm.integration.protocol import WorkerReply, attach_reply, read_plan

        ids = list(out.num_scheduled_tokens)
        sampled = [[] if self.sched.requests[r].is_prefill_chunk else [11] for r in ids]
        runner_output = ModelRunnerOutput(req_ids=ids,
                                          req_id_to_index={r: i for i, r in enumerate(ids)},
                                          sampled_token_ids=sampled)
        plan = read_plan(out)
        if plan is None:
            return runner_output
        mgr = self.sched.nexus_manager
        evidence: dict[str, dict[str, np.ndarray]] = {}
        for req_id, sreq in plan.score.items():
            live = len(live_indices(mgr, req_id, sreq.tokens_after))
            for kind in sreq.kinds:
                # A rows kind: row-normalised rows; a blocks kind: positive values.
                if evidence_kind(kind).layout == "rows":
                    values = self.rng.random((sreq.window, live)) + 0.01
                    values /= values.sum(axis=1, keepdims=True)
                else:
                    values = self.rng.random(live) + 0.5
                evidence.setdefault(kind, {})[req_id] = values.astype(np.float32)
        return attach_reply(runner_output, WorkerReply(step_id=plan.step_id,
                                                       evidence=evidence))


def _run(model_dir: pathlib.Path, mode: str, async_scheduling: bool,
         monkeypatch: pytest.MonkeyPatch) -> PoolLoop:
    monkeypatch.setenv("NEXUS_VLLM_SELF_CHECK", "1")  # the plugin's pool self-check on
    loop = PoolLoop(make_scheduler(model_dir, mode, async_scheduling=async_scheduling))
    for base, answers in WORKLOAD.items():
        for r in range(BLOCK):
            for answer in answers:
                loop.add(f"p{base + r}-a{answer}", base + r, answer)
    loop.run()
    return loop


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", list(MODES))
def test_pool_peak_within_bound_for_every_residue(model_dir: pathlib.Path, mode: str,
                                                  async_scheduling: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    loop = _run(model_dir, mode, async_scheduling, monkeypatch)
    mgr = loop.sched.nexus_manager
    assert loop.k == (2 if async_scheduling else 1)
    assert len(loop.peaks) == len(loop.prompts) == BLOCK * sum(map(len, WORKLOAD.values()))
    over = {r: (loop.prompts[r], loop.peaks[r], loop.bounds[r]) for r in loop.peaks
            if loop.peaks[r] > loop.bounds[r]}
    assert not over, f"(prompt, vLLM pool peak, bound) over the bound: {over}"
    # The plugin's self-check read the same lists, and found every bound held.
    assert loop.check_peaks == loop.peaks
    assert mgr.admission.pool is not None and mgr.admission.pool.over_bound is not None
    assert mgr.admission.pool.over_bound <= 0
    # Nothing was preempted or dropped, events fired, every block came back.
    assert dict(mgr.counters.faults) == {}
    assert mgr.counters.evicted_blocks > 0
    assert loop.pool.get_num_free_blocks() == loop.pool.num_gpu_blocks - 1
    assert not loop.sched.requests
    # The bound is tight where the prompt sets it: a long prompt computed whole before
    # its first event (end, keep) peaks at exactly its blocks, or more (keep, decoding).
    for req_id, prompt in loop.prompts.items():
        if prompt >= LONG and mode in ("end", "keep"):
            assert loop.peaks[req_id] >= -(-prompt // BLOCK), req_id
        if prompt >= LONG and mode == "end":
            assert loop.peaks[req_id] == loop.bounds[req_id] == -(-prompt // BLOCK), req_id


def test_one_request_at_a_time_peaks_at_its_prompt_blocks(
        model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand check on SmolLM2 (``end``, one request at a time, a prompt computed in
    one step), every residue: the pool holds the prompt's blocks and no more, also when
    the prompt fills its last block and the first decode token needs a new one (that
    block comes after the prompt-end event freed the prompt's)."""
    monkeypatch.setenv("NEXUS_VLLM_SELF_CHECK", "1")
    for async_scheduling in (False, True):
        loop = PoolLoop(make_scheduler(model_dir, "end", async_scheduling=async_scheduling))
        for r in range(BLOCK):
            prompt = 2 * BUDGET + r
            req_id = f"p{prompt}"
            loop.add(req_id, prompt, BLOCK + 1)
            loop.run()
            assert loop.peaks[req_id] == loop.bounds[req_id] == -(-prompt // BLOCK), \
                (async_scheduling, prompt, loop.peaks[req_id], loop.bounds[req_id])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_resumed_request_stays_within_its_bound(model_dir: pathlib.Path, mode: str,
                                                   async_scheduling: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Preempted after a block of answer, every request resumes by recomputing its prompt
    and its answer so far as one prefill: more than its prompt's blocks (end, keep: its
    prompt is evicted only after that). Admission reserved that (``bound_blocks`` with
    ``recompute_tokens``), and the pool stays within it, for every residue."""
    monkeypatch.setenv("NEXUS_VLLM_SELF_CHECK", "1")
    loop = PoolLoop(make_scheduler(model_dir, mode, async_scheduling=async_scheduling))
    for r in range(BLOCK):
        loop.add(f"p{LONG + r}", LONG + r, 3 * BLOCK)
    loop.run(until=lambda: all(req.num_output_tokens >= BLOCK
                               for req in loop.sched.requests.values()))
    fresh = dict(loop.bounds)
    loop.preempt_all()
    loop.run()
    mgr = loop.sched.nexus_manager
    over = {r: (loop.prompts[r], loop.peaks[r], loop.bounds[r]) for r in loop.peaks
            if loop.peaks[r] > loop.bounds[r]}
    assert not over, f"(prompt, vLLM pool peak, bound) over the bound: {over}"
    assert loop.check_peaks == loop.peaks
    assert mgr.admission.pool is not None and mgr.admission.pool.over_bound is not None
    assert mgr.admission.pool.over_bound <= 0
    assert loop.pool.get_num_free_blocks() == loop.pool.num_gpu_blocks - 1
    if mode == "end":
        # The recompute (prompt + a block of answer, no chunk cap) is held whole until
        # its event: over the prompt's blocks, which a new request's bound is.
        assert all(loop.peaks[r] > fresh[r] for r in fresh), (loop.peaks, fresh)


def test_recompute_tokens_leave_a_new_requests_bound_unchanged() -> None:
    """``recompute_tokens`` up to the prompt (a new request) changes no bound; past it,
    the bound never shrinks and never exceeds the whole sequence."""
    from nexus_vllm.core import EvictionConfig, cdiv

    for flags, cap in MODES.values():
        cfg = EvictionConfig(method="nexus", max_tokens=BUDGET, block_size=BLOCK,
                             chunk_size=cap or STEP_TOKENS, **flags)
        for prompt in range(1, 12 * BLOCK, 7):
            for total in (prompt + 1, prompt + BLOCK, prompt + 9 * BLOCK):
                fresh = bound_blocks(cfg, prompt, total)
                assert bound_blocks(cfg, prompt, total, recompute_tokens=prompt) == fresh
                for extra in (1, BLOCK, total - prompt):
                    resumed = bound_blocks(cfg, prompt, total,
                                               recompute_tokens=prompt + extra)
                    assert fresh <= resumed <= cdiv(total, BLOCK)
