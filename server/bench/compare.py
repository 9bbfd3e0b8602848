"""`cellserve bench compare A.json B.json ...`: several `bench serve --out` results side by side.

Each file is one server measured with the same workload; the table lists output tokens/s and TTFT
p50/p99 per level with each server's ratio to the first, and `--plot FILE` draws output tokens/s
against concurrency (or request rate) for all of them in one chart.
"""

import argparse
import json
from pathlib import Path


def load(path: str, name: str | None) -> dict:
    data = json.loads(Path(path).read_text())
    return {"name": name or data["config"].get("model") or Path(path).stem, "levels": data["levels"]}


def table(runs: list[dict]) -> str:
    base = {lv["level"]["label"]: lv["summary"]["output_throughput"] for lv in runs[0]["levels"]}
    lines = [f"{'server':24} {'level':16} {'tok/s':>8} {'ratio':>6} {'TTFT p50':>9} {'TTFT p99':>9}"]
    for run in runs:
        for lv in run["levels"]:
            s, label = lv["summary"], lv["level"]["label"]
            ratio = s["output_throughput"] / base[label] if base.get(label) else float("nan")
            ttft = s.get("ttft") or {}
            lines.append(f"{run['name']:24} {label:16} {s['output_throughput']:8.1f} {ratio:6.2f} "
                         f"{ttft.get('p50', float('nan')):9.1f} {ttft.get('p99', float('nan')):9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cellserve bench compare", description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="JSON files written by `cellserve bench serve --out`")
    ap.add_argument("--names", help="comma-separated display names, one per file")
    ap.add_argument("--plot", help="write the throughput chart to this PNG file")
    args = ap.parse_args(argv)
    names = args.names.split(",") if args.names else [None] * len(args.results)
    if len(names) != len(args.results):
        ap.error(f"{len(args.results)} files but {len(names)} names")
    runs = [load(p, n) for p, n in zip(args.results, names)]
    print(table(runs))
    if args.plot:
        from server.bench.plots import plot_servers  # matplotlib is slow to import; only when asked

        plot_servers(runs, args.plot)
        print("plot:", args.plot)
    return 0
