"""Speculative decoding over HTTP, auto against off request by request: two servers up at once (issue 29).

    python -m server.bench.spec_paired --model M --workloads quote,edit,summarise --requests 12 --seed 1 \\
        --out DIR [--serve-args "--threads 2 ..."] [--auto-args "--draft-model ..."]

`spec_rounds` measures a round's `auto` server, then its `off` server: on a shared VM whose speed drifts by
20% within minutes (the same `off` server and prompts gave 140 and 179 tok/s in two rounds), a round's ratio
carries that drift. Here a fresh `auto` and a fresh `off` server run side by side and every prompt goes to
both, one after the other (which one first alternates), one client, greedy, streamed: a slow minute slows
both sides of a pair. Per workload it prints each request's decode-only ratio, the tok/s of each mode over all
its requests (output tokens over the summed latencies, prefill included, as `cellserve bench serve` counts)
and their ratio, the drafted tokens kept and whether the texts matched; the records go to
`DIR/paired.jsonl`, the summary to `DIR/paired.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import time
from pathlib import Path

import httpx

from engine.bench.machine import machine
from server.bench.client import RequestOptions, build_request, stream_request
from server.bench.copying import COPY_KINDS, CopyWorkload
from server.bench.records import RequestRecord
from server.bench.side_by_side import stop_server
from server.bench.spec_rounds import COPY, SERVE, start_server

MODES = ("auto", "off")


def summarise_pairs(records: list[dict]) -> dict:
    """Per workload, from paired records (workload, index, mode, tokens, latency, ttft, digest, accepted,
    rejected): each mode's tok/s over all its requests, their ratio, decode-only ratios per request, drafted
    tokens kept and matching texts."""
    out: dict[str, dict] = {}
    for workload in dict.fromkeys(r["workload"] for r in records):
        by = {(r["index"], r["mode"]): r for r in records if r["workload"] == workload}
        pairs = sorted({i for i, m in by if all((i, mode) in by for mode in MODES)})
        tok_s = {m: sum(by[i, m]["tokens"] for i in pairs) / sum(by[i, m]["latency"] for i in pairs) for m in MODES}
        decode = [(by[i, "off"]["latency"] - by[i, "off"]["ttft"]) / (by[i, "auto"]["latency"] - by[i, "auto"]["ttft"])
                  for i in pairs]
        accepted = sum(by[i, "auto"]["accepted"] for i in pairs)
        drafted = accepted + sum(by[i, "auto"]["rejected"] for i in pairs)
        out[workload] = {"requests": len(pairs), "auto_tok_s": tok_s["auto"], "off_tok_s": tok_s["off"],
                         "ratio": tok_s["auto"] / tok_s["off"], "decode_ratios": decode,
                         "kept": accepted / drafted if drafted else 0.0,
                         "same": sum(by[i, "auto"]["digest"] == by[i, "off"]["digest"] for i in pairs)}
    return out


async def _one(client: httpx.AsyncClient, url: str, workload: str, index: int, args) -> RequestRecord:
    prompt = CopyWorkload(workload, COPY["input_len"], args.output_len, seed=args.seed).prompt(index)
    path, body = build_request(RequestOptions(model="default", endpoint="chat"), prompt)
    body.pop("model")
    rec = RequestRecord(index=index, kind="chat", max_tokens=prompt.max_tokens, prompt_words=prompt.words)
    return await stream_request(client, url + path, body, rec, {})


async def _pairs(urls: dict[str, str], args, sink) -> list[dict]:
    records = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for workload in args.workloads.split(","):
            for index in range(args.requests):
                for mode in (MODES if index % 2 == 0 else MODES[::-1]):
                    rec = await _one(client, urls[mode], workload, index, args)
                    if rec.error is not None:
                        raise RuntimeError(f"{workload} #{index} on {mode}: {rec.error} {rec.error_message}")
                    row = {"workload": workload, "index": index, "mode": mode, "tokens": rec.output_tokens,
                           "latency": rec.latency, "ttft": rec.ttft, "digest": rec.output_digest,
                           "accepted": rec.accepted_draft_tokens or 0, "rejected": rec.rejected_draft_tokens or 0}
                    records.append(row)
                    sink.write(json.dumps(row) + "\n")
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.bench.spec_paired", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--workloads", default=",".join(COPY_KINDS))
    p.add_argument("--requests", type=int, default=12, help="prompts per workload, each sent to both servers")
    p.add_argument("--output-len", type=int, default=COPY["output_len"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8123, help="auto's port; off listens on the next one")
    p.add_argument("--out", required=True)
    p.add_argument("--serve-args", default="--threads 2 --n-cells 16384 --max-num-batched-tokens 2048")
    p.add_argument("--auto-args", default="", help="more serve flags for the auto server only")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("machine:", machine())
    procs, urls = [], {}
    try:
        for k, mode in enumerate(MODES):
            cmd = [*SERVE, "--model", args.model, "--port", str(args.port + k), "--speculative", mode,
                   *shlex.split(args.serve_args), *(shlex.split(args.auto_args) if mode == "auto" else [])]
            print(shlex.join(cmd))
            urls[mode] = f"http://127.0.0.1:{args.port + k}"
            procs.append(start_server(cmd, urls[mode], out / f"server-{mode}.log"))
        started = time.time()
        with (out / "paired.jsonl").open("a") as sink:
            records = asyncio.run(_pairs(urls, args, sink))
    finally:
        for proc in procs:
            stop_server(proc)
    summary = summarise_pairs(records)
    (out / "paired.json").write_text(json.dumps({"argv": argv, "started": started, "workloads": summary}, indent=1))
    for workload, s in summary.items():
        print(f"{workload}: auto {s['auto_tok_s']:.1f} / off {s['off_tok_s']:.1f} tok/s = {s['ratio']:.2f}x over "
              f"{s['requests']} requests; decode per request " + " ".join(f"{r:.2f}" for r in s["decode_ratios"])
              + f"; kept {s['kept']:.0%}; same text {s['same']}/{s['requests']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
