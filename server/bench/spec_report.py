"""The table and chart of `python -m server.bench.spec_rounds` runs: auto / off per round, from DIR/levels.jsonl.

A ratio is only ever taken between an auto server and an off server of the same round (same prompts, run
one after the other); `same` compares the two servers' streamed texts request by request (digests).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def load(folder: Path) -> list[dict]:
    lines = (folder / "levels.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def rows(levels: list[dict]) -> list[dict]:
    """One row per (file, workload, clients): each round's auto and off tok/s and ratio, the share of drafted
    tokens kept under auto, how many requests streamed the same text, and llama-server's figures where run."""
    by: dict[tuple, dict] = defaultdict(dict)
    for lv in levels:
        if "tok_s" in lv:
            by[lv["label"], lv["workload"], lv["clients"]][lv["mode"], lv["round"]] = lv
    out = []
    for (label, workload, clients), got in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        rounds = sorted({r for m, r in got if m in ("auto", "off")})
        pairs = [(got[("auto", r)], got[("off", r)]) for r in rounds if ("auto", r) in got and ("off", r) in got]
        drafted = sum(a["drafted"] for a, _ in pairs)
        same = [sum(a["digests"].get(k) == v for k, v in o["digests"].items() if not k.endswith("answer"))
                for a, o in pairs]
        total = [sum(not k.endswith("answer") for k in o["digests"]) for _, o in pairs]
        llama = {m: [lv["tok_s"] for (mm, _), lv in got.items() if mm == m] for m in ("llama-none", "llama-ngram")}
        out.append({
            "label": label, "workload": workload, "clients": clients,
            "auto": [a["tok_s"] for a, _ in pairs], "off": [o["tok_s"] for _, o in pairs],
            "ratio": [a["tok_s"] / o["tok_s"] for a, o in pairs if o["tok_s"]],
            "cpu_ratio": [(o["server_cpu_s"] / o["tokens"]) / (a["server_cpu_s"] / a["tokens"])
                          for a, o in pairs if a["tokens"] and o["tokens"] and a["server_cpu_s"]],
            "kept": sum(a["accepted"] for a, _ in pairs) / drafted if drafted else None,
            "same": f"{sum(same)}/{sum(total)}", "load": [lv.get("load", 0) for a, o in pairs for lv in (a, o)],
            **{m: v for m, v in llama.items() if v},
        })
    return out


def _span(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def table(rs: list[dict]) -> str:
    head = ("| file | workload | clients | off tok/s | auto tok/s | auto / off | CPU per token off / auto "
            "| drafted kept | same text | llama-server none / ngram-simple |")
    lines = [head, "|" + "---|" * 10]
    for r in rs:
        lam = " / ".join(_span(r.get(m, []), "{:.1f}") or "-" for m in ("llama-none", "llama-ngram"))
        lines.append(f"| {r['label']} | {r['workload']} | {r['clients']} | {', '.join(f'{v:.1f}' for v in r['off'])} "
                     f"| {', '.join(f'{v:.1f}' for v in r['auto'])} | **{_span(r['ratio'])}** | {_span(r['cpu_ratio'])} "
                     f"| {'' if r['kept'] is None else format(r['kept'], '.0%')} | {r['same']} "
                     f"| {lam if r.get('llama-none') or r.get('llama-ngram') else ''} |")
    return "\n".join(lines)


def plot(rs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rs if r["ratio"]]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(shown) + 2), 4.2))
    colors = {1: "tab:blue", 8: "tab:orange", 32: "tab:green"}
    for i, r in enumerate(shown):
        mean = sum(r["ratio"]) / len(r["ratio"])
        ax.bar(i, mean, color=colors.get(r["clients"], "tab:gray"), alpha=0.75)
        ax.scatter([i] * len(r["ratio"]), r["ratio"], color="black", s=12, zorder=3)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(1.8, color="tab:red", lw=0.8, ls="--", label="1.8x (the bar at 1 client)")
    ax.set_xticks(range(len(shown)), [f"{r['workload']}\n{r['label']} c{r['clients']}" for r in shown],
                  rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("tok/s, auto / off (same round)")
    ax.set_title("cellserve speculative decoding over HTTP, auto / off (SmolLM2-135M-Instruct)", fontsize=9)
    for c, col in colors.items():
        ax.bar([0], [0], color=col, alpha=0.75, label=f"{c} client{'s' if c > 1 else ''}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(folder: Path, plot_path: str | None = None) -> str:
    rs = rows(load(folder))
    text = table(rs)
    print(text)
    (folder / "table.md").write_text(text + "\n")
    (folder / "summary.json").write_text(json.dumps(rs, indent=1))
    if plot_path:
        plot(rs, plot_path)
        print(f"chart: {plot_path}")
    return text
