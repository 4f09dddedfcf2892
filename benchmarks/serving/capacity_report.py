"""The docs side of the serving capacity benchmark: tables, plots and the docs section,
from a ``capacity.json`` that ``benchmarks/serving/capacity.py`` wrote.

``capacity.py`` measures (servers, ``vllm bench serve``, ``/metrics`` polls) and writes
``capacity.json``: the settings, the derived pool and budget, each server's flags and
one row per config and concurrency level. This module reads only that JSON and writes,
next to it (or into ``--out``):

* ``capacity.md``: the table and the headline (each evicting config against ``stock``);
* ``throughput.png``, ``preemptions.png``, ``pool_usage.png``, ``running.png``;

and with ``--update-docs`` the section between ``<!-- serving:begin -->`` and
``<!-- serving:end -->`` of ``docs/performance.md`` (created at the end if missing), with
the PNGs copied to ``docs/figures/serving/``. A config evicts when its server got
``--kv-eviction`` (its flags in the JSON), so the report keeps no list of config names.

    python benchmarks/serving/capacity_report.py runs/serving_capacity/capacity.json
    python benchmarks/serving/capacity_report.py CAPACITY_JSON --update-docs

(``capacity.py --from-json CAPACITY_JSON [--update-docs]`` does the same.)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "performance.md"
FIGURES = REPO / "docs" / "figures" / "serving"
BEGIN, END = "<!-- serving:begin -->", "<!-- serving:end -->"
PLOTS = {
    "throughput": ("output_tok_s", "output tokens / s"),
    "preemptions": ("preemptions", "preemptions (during the level)"),
    "pool_usage": ("peak_pool_blocks", "peak KV blocks in use (pool)"),
    "running": ("peak_running", "peak running requests"),
}


# -- what the JSON says about its configs -----------------------------------------------
def config_names(result: dict[str, Any]) -> list[str]:
    """The configs with at least one row, in the order they ran."""
    return list(dict.fromkeys(r["config"] for r in result["rows"]))


def evicting_configs(result: dict[str, Any]) -> set[str]:
    """The configs whose server ran with ``--kv-eviction`` (the others are references)."""
    return {name for name, server in result["servers"].items()
            if "--kv-eviction" in server.get("flags", ())}


# -- tables and plots -------------------------------------------------------------------
def _fmt(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def headline(rows: list[dict[str, Any]], names: list[str], evicting: set[str]) -> dict[str, Any]:
    """The numbers the issue asks for, each against ``stock`` of the same run; the
    configs not in ``evicting`` are the references whose preemptions are reported."""
    by = {n: {r["concurrency"]: r for r in rows if r["config"] == n} for n in names}
    top = max((r["concurrency"] for r in rows), default=None)
    out: dict[str, Any] = {"top_level": top, "no_preemption_concurrency": {},
                           "concurrency_ratio": {}, "throughput_ratio_top": {},
                           "preempts_at": {}, "throughput_ratio_when_preempting": {},
                           "overhead_max": {}}
    for n, rs in by.items():
        clean = [r["peak_running"] for r in rs.values()
                 if r["preemptions"] == 0 and r["failed"] == 0]
        out["no_preemption_concurrency"][n] = max(clean) if clean else 0
    stock = by.get("stock", {})
    base = out["no_preemption_concurrency"].get("stock")
    for n, rs in by.items():
        if n == "stock":
            continue
        if base:
            out["concurrency_ratio"][n] = out["no_preemption_concurrency"][n] / base
        if top in rs and top in stock and stock[top]["output_tok_s"] > 0:
            out["throughput_ratio_top"][n] = rs[top]["output_tok_s"] / stock[top]["output_tok_s"]
        ovh = [r["overhead"] for r in rs.values() if r["overhead"] is not None]
        if ovh:
            out["overhead_max"][n] = max(ovh)
            out.setdefault("overhead_split", {})[n] = {
                k: round(sum(r[k] for r in rs.values()), 2)
                for k in ("scoring_s", "policy_s", "step_s", "eviction_events")}
    for ref in (n for n in by if n not in evicting):
        levels = sorted(c for c, r in by[ref].items() if r["preemptions"] > 0)
        out["preempts_at"][ref] = levels
        out["throughput_ratio_when_preempting"][ref] = {
            n: {c: rs[c]["output_tok_s"] / by[ref][c]["output_tok_s"]
                for c in levels if c in rs and by[ref][c]["output_tok_s"] > 0}
            for n, rs in by.items() if n in evicting}
    return out


def table_md(rows: list[dict[str, Any]], evicting: set[str]) -> str:
    stock = {r["concurrency"]: r for r in rows if r["config"] == "stock"}
    head = ("| config | conc. | done | failed | peak running | preempt. | out tok/s | vs stock "
            "| TTFT p50 / p99 ms | TPOT p50 / p99 ms | peak pool blocks | peak blocks/req "
            "| adm. waits | overhead | load |")
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        ref = stock.get(r["concurrency"])
        ratio = (f"{r['output_tok_s'] / ref['output_tok_s']:.2f}x"
                 if ref and ref["output_tok_s"] > 0 else "-")
        evict = r["config"] in evicting
        ovh = f"{100 * r['overhead']:.1f}%" if r["overhead"] is not None else "-"
        lines.append(
            f"| {r['config']} | {r['concurrency']} | {r['completed']} | {r['failed']} "
            f"| {r['peak_running']} | {r['preemptions']} | {r['output_tok_s']:.1f} | {ratio} "
            f"| {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
            f"| {r['tpot_p50_ms']:.0f} / {r['tpot_p99_ms']:.0f} "
            f"| {r['peak_pool_blocks']:.0f} | {r['peak_blocks_per_request']:.1f} "
            f"| {r['admission_waits'] if evict else '-'} | {ovh} | {r.get('load1', '-')} |")
    return "\n".join(lines)


def headline_md(h: dict[str, Any], d: dict[str, int]) -> str:
    npc = h["no_preemption_concurrency"]
    lines = ["Largest number of concurrent requests served without preemption "
             "(peak `vllm:num_requests_running` over the levels with no preemption): "
             + ", ".join(f"{n} **{v}**" for n, v in npc.items())
             + f" (admission alone allows stock {d['stock_fit']}, evicting "
             f"{d['evicting_fit']}).", ""]
    for n, ratio in h["concurrency_ratio"].items():
        line = (f"- **{n}**: {ratio:.2f}x stock's concurrency without preemption; output "
                f"throughput at concurrency {h['top_level']}: "
                f"{_fmt(h['throughput_ratio_top'].get(n), '.2f')}x stock")
        if n in h["overhead_max"]:
            sp = h["overhead_split"][n]
            line += (f"; eviction overhead at most {_pct(h['overhead_max'][n]):.1f}% of "
                     f"step time (all levels: scoring {sp['scoring_s']:.1f} s + policy "
                     f"{sp['policy_s']:.1f} s of {sp['step_s']:.1f} s, "
                     f"{sp['eviction_events']:.0f} events)")
        lines.append(line + ".")
    for ref, levels in h["preempts_at"].items():
        if not levels:
            lines.append(f"- {ref} did not preempt at any level"
                         + (": it queues a request until its whole prompt fits (vLLM 0.32 "
                            "reserves the full input at admission)." if ref == "stock"
                            else "."))
            continue
        for n, by_c in h["throughput_ratio_when_preempting"][ref].items():
            pairs = ", ".join(f"c={c}: {v:.2f}x" for c, v in by_c.items())
            lines.append(f"- where {ref} preempts, {n}'s output throughput vs {ref}: {pairs}")
    return "\n".join(lines)


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x


def plots(rows: list[dict[str, Any]], names: list[str], out: pathlib.Path,
          d: dict[str, int]) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for fname, (key, label) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for i, n in enumerate(names):
            rs = sorted((r for r in rows if r["config"] == n), key=lambda r: r["concurrency"])
            if rs:
                # Markers shrink from config to config so that equal values stay visible.
                ax.plot([r["concurrency"] for r in rs], [r[key] for r in rs],
                        marker="osD^vx"[i % 6], markersize=max(10 - 2 * i, 3), label=n,
                        linestyle="-" if n in ("stock", "nexus") else "--")
        if key == "peak_pool_blocks":
            ax.axhline(d["usable_blocks"], color="grey", linewidth=0.8, linestyle=":")
            ax.text(0.02, d["usable_blocks"], " pool", va="bottom", fontsize=8,
                    transform=ax.get_yaxis_transform())
        ax.set_xscale("log", base=2)
        levels = sorted({r["concurrency"] for r in rows})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("client concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{fname}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths



def docs_section(result: dict[str, Any], pngs: list[pathlib.Path],
                 rel: str = "figures/serving") -> str:
    """The docs section of ``result`` (markers included); ``rel`` is where the docs page
    finds ``pngs``."""
    d, s = result["derived"], result["settings"]
    names, evicting = config_names(result), evicting_configs(result)
    where = "GPU" if result["gpu"] else "CPU"
    figs = " ".join(f"![{p.stem}]({rel}/{p.name})" for p in pngs)
    return "\n".join([
        BEGIN,
        f"## Serving: capacity and speed against stock vLLM ({where})",
        "",
        "Produced by `benchmarks/serving/capacity.py` (do not edit by hand; rerun with "
        "`--update-docs`):",
        "",
        "```bash",
        result["command"],
        "```",
        "",
        f"- **Machine:** {result['machine']}; load average {result['load_before']} before, "
        f"{result['load_after']} after (shared box: timings are noisy). Wall time "
        f"{result['wall_s'] / 60:.1f} min.",
        f"- **Model:** `{pathlib.Path(result['model']).name}`; random prompts of "
        f"{s['input_len']} tokens, {s['output_len']} output tokens (EOS ignored), "
        f"`vllm bench serve --max-concurrency` at each level, "
        f"max({s['prompts_per_slot']} x level, {s['min_prompts']}) prompts per level.",
        f"- **Same pool for every config:** `--num-gpu-blocks-override {d['pool_blocks']}` "
        f"({d['usable_blocks']} usable blocks of {d['block_size']} tokens), `--max-model-len "
        f"{d['max_model_len']}`, prefix caching off. A stock request holds "
        f"{d['seq_blocks']} blocks at its end.",
        f"- **Eviction:** `--kv-budget {d['budget_tokens']}` ({s['keep']:.0%} of the input "
        f"rounded up to blocks: {d['budget_blocks']} blocks), `--kv-chunk-size "
        f"{d['chunk_tokens']}`: bound = {d['bound_blocks']} blocks per request"
        + (f" at {d['bound_at']} prompt tokens (each row's follows the longest prompt it "
           "sent: the random prompts re-encode to about that length)."
           if "bound_at" in d else "."),
        *([f"- **stock-chunked:** stock vLLM with `--long-prefill-token-threshold "
           f"{d['chunk_tokens']} --no-scheduler-reserve-full-isl` (the evicting servers' "
           "chunk, admission by the first chunk as before vLLM 0.32)."]
          if "stock-chunked" in names else []),
        *([f"- **Knobs:** {evicting_knobs_md()}."]
          if evicting & set(names) else []),
        "- **Columns:** peak running = max of `vllm:num_requests_running` polled every "
        f"{s['poll']} s; preempt. = delta of `vllm:num_preemptions_total`; peak pool = "
        "`vllm:kv_cache_usage_perc` x usable blocks; peak blocks/req = "
        "`vllm:nexus_live_blocks_max` (its high-water mark) for evicting servers, peak "
        "pool / running for stock; adm. waits = delta of `vllm:nexus_admission_waits_total`; "
        "overhead = delta (scoring + policy seconds) / delta step seconds of the "
        "`vllm:nexus_*` counters; load = the box's 1-minute load average as the level "
        "ended (2 cores: above ~2, other jobs were taking CPU from the run).",
        "",
        table_md(result["rows"], evicting),
        "",
        headline_md(headline(result["rows"], names, evicting), d),
        *(["", caveat] if (caveat := load_caveat(result)) else []),
        "",
        figs,
        END,
    ])


def evicting_knobs_md() -> str:
    """What the evicting configs score with: the defaults, unless a name carries knobs."""
    from nexus_vllm.core import EvictionConfig

    cfg = EvictionConfig()
    return (f"evicting servers score with the defaults (`prompt_window` "
            f"{cfg.prompt_window}, `window` {cfg.window}, `skip_layers` {cfg.skip_layers}, "
            f"`layer_stride` {cfg.layer_stride}) unless their name carries knobs, which they "
            "get as `--additional-config '{\"nexus\": {...}}'`")


def load_caveat(result: dict[str, Any]) -> str:
    """A warning when other jobs loaded the box during the run ('' when it was quiet)."""
    if result["gpu"]:
        return ""
    cores = os.cpu_count() or 1
    loads = [r["load1"] for r in result["rows"] if r.get("load1") is not None]
    if not loads or max(loads) <= 1.5 * cores:
        return ""
    return (f"**Caveat: a loaded box.** The 1-minute load average was "
            f"{min(loads):.1f}-{max(loads):.1f} on {cores} cores while the levels ran "
            "(other jobs). Configs run one after another, so throughput, TTFT and TPOT "
            "ratios between configs mix in how the load changed; concurrency, preemptions "
            "and pool/blocks-per-request numbers do not depend on speed. The overhead is a "
            "ratio within one server but also grows with contention.")


def update_docs(result: dict[str, Any], pngs: list[pathlib.Path], *,
                docs: pathlib.Path = DOCS, figures: pathlib.Path = FIGURES) -> None:
    """Copy ``pngs`` to ``figures`` and write the section of ``result`` into ``docs``
    between ``BEGIN`` and ``END`` (appended when the markers are missing)."""
    figures.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in pngs:
        shutil.copy2(p, figures / p.name)
        copied.append(figures / p.name)
    section = docs_section(result, copied, rel=os.path.relpath(figures, docs.parent))
    text = docs.read_text()
    if BEGIN in text and END in text:
        pre, rest = text.split(BEGIN, 1)
        post = rest.split(END, 1)[1]
        text = pre + section + post
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    docs.write_text(text)


# -- main -------------------------------------------------------------------------------
def report(result: dict[str, Any], out: pathlib.Path, update: bool,
           docs: pathlib.Path = DOCS, figures: pathlib.Path = FIGURES) -> str:
    """Write the table and headline of ``result`` (``capacity.md``) and its plots into
    ``out``, and with ``update`` the docs section; return the markdown."""
    rows, derived = result["rows"], result["derived"]
    names, evicting = config_names(result), evicting_configs(result)
    pngs = plots(rows, names, out, derived) if rows else []
    md = (table_md(rows, evicting) + "\n\n"
          + headline_md(headline(rows, names, evicting), derived) + "\n")
    if caveat := load_caveat(result):
        md += "\n" + caveat + "\n"
    (out / "capacity.md").write_text(md)
    if update:
        update_docs(result, pngs, docs=docs, figures=figures)
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("capacity_json", type=pathlib.Path,
                   help="a capacity.json written by benchmarks/serving/capacity.py")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="where capacity.md and the plots go (default: next to the JSON)")
    p.add_argument("--update-docs", action="store_true",
                   help="write the section of docs/performance.md and docs/figures/serving/")
    args = p.parse_args(argv)
    result = json.loads(args.capacity_json.read_text())
    out = args.out or args.capacity_json.parent
    out.mkdir(parents=True, exist_ok=True)
    print("\n" + report(result, out, args.update_docs))
    if args.update_docs:
        print(f"updated {DOCS} and {FIGURES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
