"""The report of `lantau bench serve` / `sweep` in an output folder: results.json, report.md,
report.html and PNG plots (latency CDFs, GPU utilisation over time, latency and throughput vs
rate), with the reference deployment's before/after table when a "before" result is given.

Works on the results' JSON form (ServeResult/SweepResult.to_dict()), so that a "before" run
saved earlier, by another build or against HF transformers, reads like this one. matplotlib is
imported only here and only if present: without it the PNGs are skipped with a log line."""

from __future__ import annotations

import html
import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "end-to-end"))

# a document as blocks, rendered twice: ("h1"|"h2"|"p", text), ("table", header, rows),
# ("img", file name, caption)
Block = tuple


def load_result(path: str | Path) -> dict:
    """A results.json, or the folder of a report that holds one."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    return json.loads(path.read_text())


def runs_of(result: dict) -> list[dict]:
    return result["runs"] if result["kind"] == "sweep" else [result]


def headline(result: dict) -> dict:
    """The reference deployment's figures of a result: a serve run's own; a sweep's at the
    highest rate that met the SLO (its last run if none did)."""
    runs = runs_of(result)
    run = runs[-1]
    best = result.get("max_rate_meeting_slo")
    if result["kind"] == "sweep" and best is not None:
        run = next(r for r in runs if r["config"]["rate"] == best)
    s = run["summary"]
    return {
        "rate": run["config"]["rate"],
        "p95_latency_ms": s["e2e"]["p95"],
        "gpu_util_pct": run.get("gpu_util_mean"),
        "requests_per_s": s["request_throughput"],
        "output_tok_s": s["output_throughput"],
    }


def _fmt(value, digits: int = 1, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:,.{digits}f}{unit}"


def _fmt_rate(rate) -> str:
    """An offered rate: "inf" (the JSON form of an infinite rate) is "all at once"."""
    return "all at once" if rate == "inf" else f"{rate:g} req/s"


def _ratio(before, after, higher_is_better: bool) -> str:
    if not before or not after:
        return "-"
    ratio = after / before if higher_is_better else before / after
    return f"{ratio:.2f}x {'better' if ratio >= 1 else 'worse'}"


def before_after_blocks(before: dict, after: dict) -> list[Block]:
    b, a = headline(before), headline(after)
    figures = [  # (row, key, digits, unit, higher is better)
        ("P95 latency (end to end)", "p95_latency_ms", 0, " ms", False),
        ("GPU utilisation", "gpu_util_pct", 1, " %", True),
        ("requests/s", "requests_per_s", 2, "", True),
        ("output tok/s", "output_tok_s", 0, "", True),
    ]
    rows = [
        [row, _fmt(b[key], digits, unit), _fmt(a[key], digits, unit), _ratio(b[key], a[key], up)]
        for row, key, digits, unit, up in figures
    ]
    note = f"offered: before {_fmt_rate(b['rate'])}, after {_fmt_rate(a['rate'])}"
    return [
        ("h2", "Before / after"),
        ("table", ["figure", "before", "after", "change"], rows),
        ("p", note),
    ]


def _config_line(run: dict, rates: str | None = None) -> str:
    c = run["config"]
    rates = rates or _fmt_rate(c["rate"])
    loop = f"concurrency {c['concurrency']}" if c["concurrency"] else "no concurrency cap"
    return (
        f"{c['base_url']}{c['endpoint']} model {c['model']}, workload {c['workload']}, "
        f"{run['summary']['num_requests']} requests a run, {rates}, {loop}, "
        f"seed {c['seed']}; SLO: {c['slo']}; started {run['started_at']}"
    )


def _latency_table(summary: dict) -> Block:
    rows = [
        [label, *(_fmt(summary[key][q], 2) for q in ("mean", "p50", "p90", "p95", "p99", "max"))]
        for key, label in LATENCIES
    ]
    return ("table", ["latency (ms)", "mean", "P50", "P90", "P95", "P99", "max"], rows)


def _throughput_table(run: dict) -> Block:
    s = run["summary"]
    header = ["requests", "completed", "errors", "duration (s)", "req/s", "output tok/s",
              "total tok/s", "goodput (req/s)", "GPU util", "SLO met"]  # fmt: skip
    row = [s["num_requests"], s["num_completed"], s["num_errors"], _fmt(s["duration_s"], 2),
           _fmt(s["request_throughput"], 2), _fmt(s["output_throughput"], 1),
           _fmt(s["total_token_throughput"], 1), _fmt(s["goodput"], 2),
           _fmt(run["gpu_util_mean"], 1, " %"), "yes" if s["meets_slo"] else "no"]  # fmt: skip
    return ("table", header, [[str(v) for v in row]])


def _breakdown_blocks(run: dict) -> list[Block]:
    b = run.get("time_breakdown")
    if not b:
        return []
    rows = [
        ["TTFT as the client saw it", _fmt(b["client_ttft_ms"], 2)],
        ["queue (arrival to first scheduling)", _fmt(b["server_queue_ms"], 2)],
        ["of which dispatch (arrival to the engine core)", _fmt(b.get("server_dispatch_ms"), 2)],
        ["prefill (first scheduling to first token)", _fmt(b["server_prefill_ms"], 2)],
        ["the server's TTFT", _fmt(b["server_ttft_ms"], 2)],
        ["outside the engine (HTTP, frontend, client)", _fmt(b["outside_engine_ttft_ms"], 2)],
        ["of which the server's HTTP, before the engine", _fmt(b.get("server_http_in_ms"), 2)],
        ["of which first token to its bytes sent", _fmt(b.get("server_http_first_chunk_ms"), 2)],
        ["of which network and client", _fmt(b.get("outside_server_ttft_ms"), 2)],
        ["ITL as the client saw it", _fmt(b["client_itl_ms"], 2)],
        ["the server's ITL", _fmt(b["server_itl_ms"], 2)],
        ["engine step, wall time", _fmt(b["step_ms"], 2)],
    ]
    note = (f"{b['engine_steps']:.0f} engine steps, {_fmt(b['tokens_per_step'], 1)} tokens "
            "sampled a step; server figures from its /metrics histograms over the run")  # fmt: skip
    gc = [
        f"{who} {_fmt(b[f'{process}_gc_paused_ms'], 1)} ms paused "
        f"({_fmt(b[f'{process}_gc_full_collections'], 0)} full collections)"
        for process, who in (("core", "engine cores"), ("frontend", "frontend"))
        if _fmt(b.get(f"{process}_gc_paused_ms")) != "-"  # the server exports them
    ]
    if gc:
        note += "; garbage collection over the run: " + ", ".join(gc)
    return [("h2", "Where the time went (means)"), ("table", ["stage", "ms"], rows), ("p", note)]


def _steps_blocks(run: dict) -> list[Block]:
    steps = run.get("engine_steps")
    if not steps:
        return []
    rows = [[kind, str(k["steps"]), _fmt(k["reqs"], 1), _fmt(k["tokens"], 1),
             _fmt(k["device_ms"], 2), _fmt(k["host_ms"], 2), _fmt(k["call_ms"], 2)]
            for kind, k in steps["by_kind"].items()]  # fmt: skip
    busy = steps["device_busy_share"]
    note = (f"{steps['steps']} steps in {steps['seconds']:.1f} s (the server's step log); "
            "device: CUDA events from where the step's stream reached it; host: its launch; "
            "call: the whole step, the wait for the step before it included")  # fmt: skip
    if busy is not None:
        note += f"; the device busy {100 * busy:.1f} % of the run"
    header = ["kind", "steps", "requests", "tokens", "device ms", "host ms", "call ms"]
    return [("h2", "Engine steps (means)"), ("table", header, rows), ("p", note)]


def _metrics_blocks(run: dict) -> list[Block]:
    m = run["server_metrics"]
    blocks: list[Block] = [("h2", "Server /metrics"), ("p", f"{m['status']}, "
                           f"{m['num_samples']} samples")]  # fmt: skip
    rows = []
    for key, v in m["series"].items():
        if "delta" in v:
            rows.append([key, "rise", _fmt(v["delta"], 3)])
        else:
            rows.append([key, "mean / max", f"{_fmt(v['mean'], 3)} / {_fmt(v['max'], 3)}"])
    if rows:
        blocks.append(("table", ["series", "over the run", "value"], rows))
    return blocks


def _server_line(run: dict) -> str | None:
    """'Server: KV cache 64 blocks (auto), tensor-parallel 2, ready in 4.1 s' from /status."""
    status = run.get("server_status")
    if not status:
        return None
    parts = []
    if "num_kv_blocks" in status:
        parts.append(f"KV cache {status['num_kv_blocks']:,} blocks "
                     f"({status.get('kv_cache_dtype', '?')})")  # fmt: skip
    if "tensor_parallel_size" in status:
        parts.append(f"tensor-parallel {status['tensor_parallel_size']}")
    total = (status.get("startup_s") or {}).get("total")
    if total is not None:
        parts.append(f"ready in {total:.1f} s")
    return "Server: " + ", ".join(parts) if parts else None


def serve_blocks(result: dict) -> list[Block]:
    s = result["summary"]
    server = _server_line(result)
    blocks: list[Block] = [
        ("h1", f"lantau bench serve: {result['config']['workload']}"),
        ("p", _config_line(result)),
        *([("p", server)] if server else []),
        _throughput_table(result),
        _latency_table(s),
    ]
    if s["errors"]:
        blocks.append(("table", ["error", "count"], [[k, str(n)] for k, n in s["errors"].items()]))
    return (blocks + _by_model_blocks(result) + _breakdown_blocks(result) + _steps_blocks(result)
            + _metrics_blocks(result))  # fmt: skip


def _by_model_blocks(result: dict) -> list[Block]:
    """With --lora-modules: each adapter's requests (the same run, its share of the traffic)."""
    by_model = result.get("by_model") or {}
    if not by_model:
        return []
    header = ["model", "requests", "output tok/s", "TTFT mean", "TTFT P95", "ITL mean",
              "ITL P95", "e2e P95", "errors"]  # fmt: skip
    rows = [[name, str(m["num_completed"]), _fmt(m["output_throughput"], 0),
             _fmt(m["ttft"]["mean"], 1), _fmt(m["ttft"]["p95"], 1), _fmt(m["itl"]["mean"], 2),
             _fmt(m["itl"]["p95"], 2), _fmt(m["e2e"]["p95"], 1),
             str(m["num_requests"] - m["num_completed"])]
            for name, m in by_model.items()]  # fmt: skip
    return [("h2", "By model (latencies in ms)"), ("table", header, rows)]


def sweep_blocks(result: dict) -> list[Block]:
    runs = result["runs"]
    best = result["max_rate_meeting_slo"]
    header = ["rate", "req/s", "output tok/s", "goodput", "TTFT P50", "TTFT P95", "TPOT P95",
              "ITL P95", "e2e P95", "GPU util", "errors", "SLO"]  # fmt: skip
    rows = []
    for run in runs:
        s = run["summary"]
        rows.append([_fmt_rate(run["config"]["rate"]), _fmt(s["request_throughput"], 2),
                     _fmt(s["output_throughput"], 0), _fmt(s["goodput"], 2),
                     _fmt(s["ttft"]["p50"], 1), _fmt(s["ttft"]["p95"], 1),
                     _fmt(s["tpot"]["p95"], 2), _fmt(s["itl"]["p95"], 2), _fmt(s["e2e"]["p95"], 0),
                     _fmt(run["gpu_util_mean"], 1, " %"), str(s["num_errors"]),
                     "met" if s["meets_slo"] else "missed"])  # fmt: skip
    if best is None:
        verdict = "none of the rates tried"
    elif runs[-1]["summary"]["meets_slo"]:
        verdict = f"{_fmt_rate(best)} (every rate tried met it)"
    else:
        verdict = _fmt_rate(best)
    rates = "rates " + ", ".join(_fmt_rate(r["config"]["rate"]) for r in runs)
    return [
        ("h1", f"lantau bench sweep: {runs[0]['config']['workload']}"),
        ("p", _config_line(runs[0], rates)),
        ("p", f"Highest rate meeting the SLO ({result['slo']}): {verdict}"),
        ("table", ["offered", *header[1:]], rows),
        (
            "p",
            "Latencies in ms; the last run is the first that missed the SLO, if any did; "
            "each run draws new prompts (seed + its place).",
        ),  # fmt: skip
    ]


# --- plots ---------------------------------------------------------------------------------


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: the report has no PNG plots")
        return None
    return plt


def plot_cdfs(runs: list[dict], path: Path, plt) -> None:
    """Each latency's empirical CDF over the completed requests, a line per run."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label) in zip(axes.flat, LATENCIES, strict=True):
        for run in runs:
            done = [r for r in run["records"] if r["ok"]]
            if key == "itl":
                values = [g for r in done for g in r["itl_s"]]
            else:
                values = [r[f"{key}_s"] for r in done if r[f"{key}_s"] is not None]
            values = sorted(1000 * v for v in values)
            if values:
                frac = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, frac, where="post", label=_fmt_rate(run["config"]["rate"]))
        ax.set(title=f"{label} CDF", xlabel="ms", ylabel="fraction of samples")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_gpu_util(runs: list[dict], path: Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(10, 3.5))
    for run in runs:
        if run["gpu_util"]:
            times, utils = zip(*run["gpu_util"], strict=True)
            ax.plot(times, utils, label=_fmt_rate(run["config"]["rate"]))
    ax.set(title="GPU utilisation (NVML)", xlabel="s from the run's start", ylabel="%",
           ylim=(0, 105))  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(runs: list[dict], latency_path: Path, throughput_path: Path, plt) -> None:
    """P50/P95 of each latency and the achieved throughput against the offered rate (one tick
    a run, so "all at once" has a place)."""
    xs = range(len(runs))
    labels = [_fmt_rate(r["config"]["rate"]) for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.5))
    for ax, (key, label) in zip(axes, LATENCIES, strict=True):
        for q in ("p50", "p95"):
            ax.plot(xs, [r["summary"][key][q] for r in runs], marker="o", label=q.upper())
        ax.set(title=f"{label} (ms)", xticks=list(xs))
        ax.set_xticklabels(labels, rotation=30, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(latency_path, dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(xs, [r["summary"]["request_throughput"] for r in runs], marker="o", label="req/s")
    ax.plot(xs, [r["summary"]["goodput"] for r in runs], marker="s", label="goodput req/s")
    ax.set(xticks=list(xs), ylabel="requests/s", title="throughput vs offered rate")
    ax.set_xticklabels(labels, rotation=30, fontsize=8)
    tok = ax.twinx()
    tok.plot(xs, [r["summary"]["output_throughput"] for r in runs], "g--", marker="^")
    tok.set_ylabel("output tok/s (dashed)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(throughput_path, dpi=100)
    plt.close(fig)


def write_plots(result: dict, out_dir: Path) -> list[Block]:
    """The PNGs for a result and the blocks that show them; none without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return [("p", "(no plots: matplotlib is not installed)")]
    runs = runs_of(result)
    blocks: list[Block] = [("h2", "Plots")]
    if result["kind"] == "sweep":
        plot_sweep(runs, out_dir / "latency_vs_rate.png", out_dir / "throughput_vs_rate.png", plt)
        blocks += [("img", "latency_vs_rate.png", "latency vs offered rate"),
                   ("img", "throughput_vs_rate.png", "throughput vs offered rate")]  # fmt: skip
    plot_cdfs(runs, out_dir / "latency_cdf.png", plt)
    blocks.append(("img", "latency_cdf.png", "latency CDFs"))
    if any(r["gpu_util"] for r in runs):
        plot_gpu_util(runs, out_dir / "gpu_util.png", plt)
        blocks.append(("img", "gpu_util.png", "GPU utilisation over time"))
    else:
        blocks.append(("p", "GPU utilisation: no NVML samples on the machine that ran the client."))
    return blocks


# --- rendering -----------------------------------------------------------------------------


def render_markdown(blocks: list[Block]) -> str:
    lines: list[str] = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2"):
            lines += [f"{'#' * int(kind[1])} {block[1]}", ""]
        elif kind == "p":
            lines += [block[1], ""]
        elif kind == "table":
            header, rows = block[1], block[2]
            lines.append("| " + " | ".join(header) + " |")
            lines.append("|" + " --- |" * len(header))
            lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
            lines.append("")
        elif kind == "img":
            lines += [f"![{block[2]}]({block[1]})", ""]
    return "\n".join(lines)


def render_html(blocks: list[Block], title: str) -> str:
    esc = html.escape
    body: list[str] = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "p"):
            body.append(f"<{kind}>{esc(block[1])}</{kind}>")
        elif kind == "table":
            head = "".join(f"<th>{esc(h)}</th>" for h in block[1])
            rows = "".join(
                "<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>"
                for row in block[2]
            )
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif kind == "img":
            body.append(f'<figure><img src="{esc(block[1])}" alt="{esc(block[2])}"></figure>')
    style = (
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
        "table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}img{max-width:100%}"
    )
    return (
        f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{esc(title)}</title>"
        f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def summary_text(result: dict) -> str:
    """The Markdown tables without plots: what the command prints."""
    blocks = sweep_blocks(result) if result["kind"] == "sweep" else serve_blocks(result)
    return render_markdown(blocks)


def write_report(result: dict, out_dir: str | Path, before: dict | None = None) -> list[Path]:
    """results.json, report.md, report.html and the PNGs in out_dir; the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    blocks = sweep_blocks(result) if result["kind"] == "sweep" else serve_blocks(result)
    if before is not None:
        blocks += before_after_blocks(before, result)
    blocks += write_plots(result, out_dir)
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, allow_nan=False))
    (out_dir / "report.md").write_text(render_markdown(blocks))
    (out_dir / "report.html").write_text(render_html(blocks, blocks[0][1]))
    return sorted(p for p in out_dir.iterdir() if p.is_file())
