"""PNG charts of a run (matplotlib, Agg backend, so no display is needed).

- `throughput.png`: request and output-token throughput against the swept variable (concurrency for
  closed loop, request rate for open loop); a single level gives a single point.
- `ttft_cdf.png`, `e2el_cdf.png`: empirical CDFs of TTFT and end-to-end latency, one line per level.
- `plot_servers`: `bench compare`'s chart, several servers' output tokens/s against concurrency.
- `plot_side_by_side`: `side_by_side plot`'s chart, one panel per llama-server/cellserve run folder.
Skipped levels and levels without successful requests are left out of the charts.
"""

from __future__ import annotations

from pathlib import Path

try:
    import matplotlib
except ImportError as exc:  # an extra: a server does not need it
    raise ImportError("charts need matplotlib: pip install 'cellserve[plots]' (make's dev install has it)") from exc

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from server.bench.metrics import Summary
from server.bench.runner import LevelResult


def _save(fig, path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def level_x(level: dict) -> float:
    """A level's place on the x axis (`Level.to_dict()`): its concurrency (closed loop), else its rate (inf: nan)."""
    if level["mode"] == "closed":
        return float(level["concurrency"] or 1)
    return float("nan") if level["request_rate"] == "inf" else level["request_rate"]


def plot_throughput(results: list[LevelResult], summaries: list[Summary | None], path: Path) -> None:
    pairs = [(level_x(r.level.to_dict()), s) for r, s in zip(results, summaries) if s is not None]
    open_loop = any(r.level.request_rate is not None for r in results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [x for x, _ in pairs]
    ax.plot(xs, [s.output_throughput for _, s in pairs], "o-", color="tab:blue", label="output tok/s")
    ax.set_xlabel("request rate (req/s)" if open_loop else "concurrency (users)")
    ax.set_ylabel("output tokens / s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, [s.request_throughput for _, s in pairs], "s--", color="tab:orange", label="req/s")
    ax2.set_ylabel("requests / s", color="tab:orange")
    if not open_loop and len(xs) > 1 and min(xs) > 0:
        ax.set_xscale("log", base=2)
    ax.set_title("throughput")
    ax.grid(True, alpha=0.3)
    _save(fig, path)


def plot_cdf(results: list[LevelResult], metric: str, path: Path) -> None:
    """Empirical CDF of `metric` ('ttft' or 'latency') in ms over successful requests, per level."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        values = sorted(getattr(r, metric) * 1000.0 for r in res.records
                        if r.ok and getattr(r, metric) is not None)
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, ys, where="post", label=res.level.label())
    ax.set_xlabel(f"{'TTFT' if metric == 'ttft' else 'end-to-end latency'} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    ax.set_title(f"{'TTFT' if metric == 'ttft' else 'E2E latency'} CDF")
    _save(fig, path)


def plot_servers(runs: list[dict], path: str) -> None:
    """`bench compare`'s chart: output tokens/s against concurrency, one line per server (`{name, levels}`)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        pts = sorted((level_x(lv["level"]), lv["summary"]["output_throughput"]) for lv in run["levels"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=run["name"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streaming clients")
    ax.set_ylabel("output tokens / s")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("same workload, same machine")
    _save(fig, path)


def plot_side_by_side(runs: list[str], path: str) -> None:
    """One panel per `side_by_side run` folder (its rows.json): output tok/s against clients, both
    servers, every round."""
    import json

    fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs), 3.2), squeeze=False)
    for ax, folder in zip(axes[0], runs):
        rows = json.loads((Path(folder) / "rows.json").read_text())["rows"]
        rss = {r["server"]: r["rss_mb"] for r in rows if r["round"] == 0 and "rss_mb" in r}
        for r in rows:
            cs = sorted(int(c) for c in r["levels"])
            ax.plot(cs, [r["levels"][str(c)]["tok_s"] for c in cs], marker="o", alpha=0.8,
                    color="tab:blue" if r["server"] == "cellserve" else "tab:orange",
                    label=r["server"] if r["round"] == 0 else None)
        ax.set_xscale("log", base=2)
        title = Path(folder).name.removeprefix("sbs-")
        if len(rss) == 2:  # peak RSS of each server's process tree in the first round
            cs, ll = rss["cellserve"], rss["llama-server"]
            title += f"\npeak RSS cellserve / llama-server\n{cs:,.0f} / {ll:,.0f} MB ({cs / ll:.2f}x)"
        elif rss:
            title += "\npeak RSS " + " / ".join(f"{k} {v:,.0f} MB" for k, v in sorted(rss.items()))
        ax.set_title(title, fontsize="small")
        ax.set_xlabel("streaming clients")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("output tok/s")
    axes[0][0].legend(fontsize="small")
    _save(fig, path)


def write_plots(results: list[LevelResult], summaries: list[Summary | None], out_dir: str | Path) -> list[Path]:
    """Write all charts into `out_dir` (created if needed); returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "throughput.png", out / "ttft_cdf.png", out / "e2el_cdf.png"]
    plot_throughput(results, summaries, paths[0])
    plot_cdf(results, "ttft", paths[1])
    plot_cdf(results, "latency", paths[2])
    return paths
