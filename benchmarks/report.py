"""From aiperf's records to figures: percentiles, goodput, KV hit rate; JSON, a markdown table, PNGs."""

from __future__ import annotations

import collections
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.aiperf_run import AiperfResult, Record, Slo
from benchmarks.provenance import Provenance

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict[int, float | None]:
    """Linear interpolation between closest ranks (numpy's default, as aiperf reports them)."""
    if not values:
        return {p: None for p in PERCENTILES}
    return {p: float(v) for p, v in zip(PERCENTILES, np.percentile(values, PERCENTILES))}


def is_good(record: Record, slo: Slo) -> bool:
    """aiperf's --goodput test: every bound met; a request without the metric (failed, or fewer than
    2 output tokens for inter_token_latency) is not good."""
    return (record.error is None and record.ttft_ms is not None and record.ttft_ms <= slo.ttft_ms
            and record.itl_ms is not None and record.itl_ms <= slo.itl_ms)


def goodput(records: list[Record], slo: Slo, duration_s: float) -> float:
    """Good requests per second of benchmark duration (aiperf: good_request_count / benchmark_duration)."""
    return sum(is_good(r, slo) for r in records) / duration_s if duration_s > 0 else 0.0


@dataclass
class Summary:
    config: str
    group: str  # the load point or workload this run belongs to
    x: float | None  # the load (requests/s or concurrency) for plots against load
    ok: int
    failed: int
    ttft_ms: dict[int, float | None]
    itl_ms: dict[int, float | None]  # gaps between streamed chunks, all requests pooled
    tpot_ms: dict[int, float | None]  # per request: (latency - TTFT) / (output tokens - 1)
    e2e_ms: dict[int, float | None]
    request_s: float
    output_tok_s: float
    goodput: float
    good: int
    aiperf_good: int | None  # aiperf's good_request_count: equals `good`
    aiperf_goodput: float | None  # over aiperf's phase window (see AiperfResult)
    kv_hit_rate: float  # cached prompt tokens / prompt tokens, as the server reported them
    errors: dict[str, int] = field(default_factory=dict)  # failed requests by aiperf's error message


def summarize(config: str, group: str, x: float | None, result: AiperfResult, slo: Slo) -> Summary:
    ok = [r for r in result.records if r.error is None]
    duration = result.duration_s
    prompt = sum(r.prompt_tokens for r in ok)
    return Summary(
        config=config, group=group, x=x, ok=len(ok), failed=len(result.records) - len(ok),
        ttft_ms=percentiles([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        itl_ms=percentiles([gap for r in ok for gap in r.chunk_gaps_ms]),
        tpot_ms=percentiles([r.itl_ms for r in ok if r.itl_ms is not None]),
        e2e_ms=percentiles([r.latency_ms for r in ok]),
        request_s=len(ok) / duration if duration else 0.0,
        output_tok_s=sum(r.output_tokens for r in ok) / duration if duration else 0.0,
        goodput=goodput(result.records, slo, duration), good=sum(is_good(r, slo) for r in result.records),
        aiperf_good=result.aiperf_good, aiperf_goodput=result.aiperf_goodput,
        kv_hit_rate=sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        errors=dict(collections.Counter(r.error for r in result.records if r.error is not None)))


def progress_line(i: int, n: int, s: Summary, wall_s: float) -> str:
    ttft, tpot = s.ttft_ms[50], s.tpot_ms[50]
    failed = f"{s.failed} FAILED ({'; '.join(s.errors)[:300]})" if s.failed else "0 failed"
    return (f"[{i}/{n}] {s.config} @ {s.group}: {s.ok} ok, {failed}, TTFT p50 {_f(ttft)} ms, "
            f"TPOT p50 {_f(tpot, 1)} ms, goodput {s.goodput:.2f} req/s ({s.good} good; aiperf {s.aiperf_good} good, "
            f"{_f(s.aiperf_goodput, 2)} req/s over its phase window), "
            f"KV hit {s.kv_hit_rate:.2f}, {wall_s:.0f} s")


def _f(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(summaries: list[Summary], note: str) -> str:
    head = ["config", "load", "ok/failed"]
    for metric in ("TTFT", "ITL", "TPOT", "e2e"):
        head += [f"{metric} p{p} ms" for p in PERCENTILES]
    head += ["req/s", "output tok/s", "goodput req/s", "KV hit rate"]
    rows = [f"| {' | '.join(head)} |", f"|{'---|' * len(head)}"]
    for s in summaries:
        cells = [s.config, s.group, f"{s.ok}/{s.failed}" + (" **FAILED**" if s.failed else "")]
        for dist, digits in ((s.ttft_ms, 0), (s.itl_ms, 1), (s.tpot_ms, 1), (s.e2e_ms, 0)):
            cells += [_f(dist[p], digits) for p in PERCENTILES]
        cells += [f"{s.request_s:.2f}", f"{s.output_tok_s:.0f}", f"{s.goodput:.2f}", f"{s.kv_hit_rate:.2f}"]
        rows.append(f"| {' | '.join(cells)} |")
    return f"{note}\n\n" + "\n".join(rows) + "\n" + failures_md(summaries)


def failures_md(summaries: list[Summary]) -> str:
    """Every run with a failed request, and why: its figures cover only the requests that succeeded."""
    failed = [s for s in summaries if s.failed]
    if not failed:
        return ""
    lines = [f"\n**FAILED: {len(failed)} of {len(summaries)} runs lost requests** (their figures cover "
             "only the requests that succeeded):\n"]
    for s in failed:
        why = "; ".join(f"{n} x {message[:300]}" for message, n in s.errors.items())
        lines.append(f"- {s.config} @ {s.group}: {s.failed} of {s.ok + s.failed} failed: {why}")
    return "\n".join(lines) + "\n"


def exit_if_failed(summaries: list[Summary], out: Path) -> None:
    """A comparison with a failed request is a failed command, after its results are written."""
    if failed := [s for s in summaries if s.failed]:
        runs = ", ".join(f"{s.config} @ {s.group} ({s.failed})" for s in failed)
        raise SystemExit(f"error: requests failed in {len(failed)} of {len(summaries)} runs: {runs}; "
                         f"see {out / 'table.md'}")


def write(out: Path, title: str, note: str, provenance: Provenance, summaries: list[Summary],
          ttfts: dict[tuple[str, str], list[float]], extra: dict | None = None) -> None:
    """summaries.json (with every run's TTFTs, for the CDFs) and table.md; the caller adds plots."""
    out.mkdir(parents=True, exist_ok=True)
    data = {"title": title, "note": note, "provenance": asdict(provenance), **(extra or {}),
            "runs": [asdict(s) for s in summaries],
            "ttft_ms": [{"config": c, "group": g, "values": v} for (c, g), v in ttfts.items()]}
    (out / "summaries.json").write_text(json.dumps(data, indent=1))
    (out / "table.md").write_text(f"# {title}\n\n{provenance.markdown()}\n\n" + table(summaries, note)
                                  + _extra_md(extra))


def _extra_md(extra: dict | None) -> str:
    return "".join(f"\n{value}\n" for key, value in (extra or {}).items() if key.endswith("_md"))


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(path: Path, ttfts: dict[tuple[str, str], list[float]], groups: list[str]) -> None:
    """One panel per group (load point or workload), one line per configuration."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3), squeeze=False, sharey=True)
    for ax, group in zip(axes[0], groups):
        for (config, g), values in ttfts.items():
            if g == group and values:
                xs = np.sort(values)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=config)
        ax.set_title(group, fontsize=9)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT ms")
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_vs_load(path: Path, summaries: list[Summary], xlabel: str) -> None:
    """ITL p50/p99, TPOT p50 and goodput against load, one line per configuration."""
    plt = _plt()
    panels = (("ITL p50 ms", lambda s: s.itl_ms[50]), ("ITL p99 ms", lambda s: s.itl_ms[99]),
              ("TPOT p50 ms", lambda s: s.tpot_ms[50]), ("goodput req/s", lambda s: s.goodput))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3))
    configs = list(dict.fromkeys(s.config for s in summaries))
    for ax, (label, value) in zip(axes, panels):
        for config in configs:
            points = [(s.x, value(s)) for s in summaries if s.config == config and value(s) is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=config)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel(xlabel)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_bars(path: Path, summaries: list[Summary], value, label: str) -> None:
    """One group of bars per workload, one bar per configuration (router policies)."""
    plt = _plt()
    groups = list(dict.fromkeys(s.group for s in summaries))
    configs = list(dict.fromkeys(s.config for s in summaries))
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(groups) * len(configs) / 3, 3))
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        ys = [next((value(s) for s in summaries if s.config == config and s.group == g), 0) for g in groups]
        ax.bar(np.arange(len(groups)) + i * width, ys, width, label=config)
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, groups, fontsize=8)
    ax.set_ylabel(label)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
