"""The vLLM objects the scheduler side reads, as Protocols: exactly what it relies on.

vLLM's own classes satisfy them (mypy checks that where ``NexusScheduler`` hands them
over); the scheduler side's unit tests build stand-ins with just these attributes. The
workers and the API-server patches name vLLM's classes themselves (under
``TYPE_CHECKING``), since they subclass or wrap them. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["EngineRequest", "KVBlock", "NewRequest", "SamplingParamsView", "StepSchedule"]


class SamplingParamsView(Protocol):
    """``vllm.SamplingParams``: a request's ``vllm_xargs`` and seed."""

    @property
    def extra_args(self) -> dict[str, Any] | None: ...

    @property
    def seed(self) -> int | None: ...


class EngineRequest(Protocol):
    """``vllm.v1.request.Request``: one request in the engine core."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...

    @property
    def sampling_params(self) -> SamplingParamsView | None: ...

    @property
    def num_preemptions(self) -> int: ...

    # vLLM's scheduler skips a running request while its step counter is below this
    # (set by the manager to hold a request whose eviction event is in flight).
    next_decode_eligible_step: int


class NewRequest(Protocol):
    """``vllm.v1.core.sched.output.NewRequestData``: a request scheduled for the first
    time (or, from vLLM 0.34, resumed after preemption)."""

    @property
    def req_id(self) -> str: ...


class StepSchedule(Protocol):
    """``vllm.v1.core.sched.output.SchedulerOutput``: one step as scheduled."""

    @property
    def finished_req_ids(self) -> set[str]: ...

    @property
    def num_scheduled_tokens(self) -> dict[str, int]: ...

    @property
    def scheduled_new_reqs(self) -> Sequence[NewRequest]: ...

    # ``CachedRequestData``; its ``resumed_req_ids`` (gone in 0.34) is read with getattr.
    @property
    def scheduled_cached_reqs(self) -> object: ...


class KVBlock(Protocol):
    """``vllm.v1.core.kv_cache_utils.KVCacheBlock``: one entry of a request's block list
    (the pool's null block where an entry was evicted)."""

    @property
    def block_id(self) -> int: ...

    @property
    def is_null(self) -> bool: ...
