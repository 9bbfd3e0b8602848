"""The human summary (printed at the end of a run) and the JSON results file.

The JSON file holds the command line, the machine, the configuration, and per level its summary
plus every per-request record, so any statistic can be recomputed later from the raw records.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from server.bench.metrics import Dist, Summary
from server.bench.multiturn import turn_stats, turns_json
from server.bench.runner import LevelResult


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _errors_text(errors: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in errors.items()) or "none"


def _dist_rows(s: Summary) -> list[list[str]]:
    named: list[tuple[str, Dist]] = [("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2EL", s.e2el)]
    if s.fork.count:
        named.append(("fork call", s.fork))
    return [[n, _fmt(d.count), _fmt(d.mean), _fmt(d.p50), _fmt(d.p90), _fmt(d.p99)] for n, d in named]


def level_text(result: LevelResult, summary: Summary | None) -> str:
    """The detailed block for one level."""
    title = f"==== {result.level.label()} ===="
    if result.skipped or summary is None:
        return f"{title}\nskipped: {result.skipped}"
    s = summary
    lines = [
        title,
        f"requests             {s.requests} (completed {s.completed}, failed {s.failed})",
        f"errors               {_errors_text(s.errors)}",
        f"duration             {s.duration_s:.2f} s",
        f"request throughput   {s.request_throughput:.2f} req/s",
        f"output throughput    {s.output_throughput:.2f} tok/s ({s.total_output_tokens} tokens)",
        f"prompt tokens        {_fmt(s.total_prompt_tokens)} (as reported by the server's usage)",
        f"achieved concurrency {s.concurrency_achieved:.2f}",
    ]
    if s.goodput is not None:
        lines.append(f"goodput              {s.goodput:.2f} req/s ({s.slo_met} of {s.requests} met the SLO)")
    if s.cleanup_failures:
        lines.append(f"cleanup failures     {s.cleanup_failures} DELETE /v1/sequences calls failed")
    header = ["latency (ms)", "n", "mean", "p50", "p90", "p99"]
    return "\n".join(lines) + "\n" + _table(header, _dist_rows(s)) + turns_text(result)


def turns_text(result: LevelResult) -> str:
    """The multi-turn workload's TTFT by turn number ('' for other workloads)."""
    stats = turn_stats(result.records)
    if not stats:
        return ""
    header = ["turn", "n", "prompt tok", "cached tok", "TTFT mean", "TTFT p50", "TTFT p90", "TTFT p99"]
    rows = [[str(t.turn), str(t.count), _fmt(t.prompt_tokens, 0), _fmt(t.cached_tokens, 0), _fmt(t.ttft.mean, 1),
             _fmt(t.ttft.p50, 1), _fmt(t.ttft.p90, 1), _fmt(t.ttft.p99, 1)] for t in stats]
    return ("\nTTFT by turn (ms; prompt/cached tok: means of the server's usage, cached = "
            "prompt_tokens_details.cached_tokens)\n" + _table(header, rows))


def sweep_text(results: list[LevelResult], summaries: list[Summary | None]) -> str:
    """One line per level: the at-a-glance comparison across a sweep."""
    header = ["level", "ok", "err", "req/s", "tok/s", "goodput", "TTFT p50", "TTFT p99",
              "TPOT p50", "ITL p99", "E2EL p50", "E2EL p99"]
    rows = []
    for res, s in zip(results, summaries):
        if s is None:
            rows.append([res.level.label(), "skipped"] + ["-"] * (len(header) - 2))
            continue
        rows.append([res.level.label(), str(s.completed), str(s.failed), _fmt(s.request_throughput),
                     _fmt(s.output_throughput, 1), _fmt(s.goodput), _fmt(s.ttft.p50, 1), _fmt(s.ttft.p99, 1),
                     _fmt(s.tpot.p50, 1), _fmt(s.itl.p99, 1), _fmt(s.e2el.p50, 1), _fmt(s.e2el.p99, 1)])
    return _table(header, rows)


def full_report(run: dict, results: list[LevelResult], summaries: list[Summary | None]) -> str:
    """The complete text printed at the end: header, one block per level, then the sweep table."""
    m = run["machine"]
    cfg = run["config"]
    head = [
        "cellserve bench serve: results",
        f"command   {run['command']}",
        f"machine   {m['platform']}; python {m['python']}; {m['cpu_count']} CPUs; {m['processor']}",
        f"server    {cfg['url']} model={cfg['model']} endpoint={cfg['endpoint']}",
        f"workload  {cfg['workload_text']}",
        "latency units: ms; TTFT = first content chunk; ITL = gap between content chunks",
    ]
    blocks = [level_text(r, s) for r, s in zip(results, summaries)]
    tail = ["==== sweep ====", sweep_text(results, summaries)] if len(results) > 1 else []
    return "\n\n".join(["\n".join(head), *blocks, *tail])


def results_json(run: dict, results: list[LevelResult], summaries: list[Summary | None]) -> dict:
    """The JSON-ready results: run info plus, per level, its summary and every record."""
    levels = []
    for res, s in zip(results, summaries):
        levels.append({
            "level": res.level.to_dict(),
            "skipped": res.skipped,
            "summary": None if s is None else s.to_dict(),
            "turns": turns_json(res.records),
            "records": [r.to_dict() for r in res.records],
        })
    return {**run, "levels": levels}


def write_json(path: str | Path, data: dict) -> Path:
    """Write `data` as indented JSON, creating parent folders; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, allow_nan=False))
    return out


def print_report(text: str) -> None:
    print(text, file=sys.stdout, flush=True)
