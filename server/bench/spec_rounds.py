"""Speculative decoding over HTTP, auto against off, in alternating fresh servers (issue 29).

    python -m server.bench.spec_rounds run --model M --label bf16 --workloads quote,edit,summarise,regen \\
        --clients 1,8 --rounds 2 --out DIR
    python -m server.bench.spec_rounds run --model M --label q4_1 --workloads random --clients 8,32 --out DIR
    python -m server.bench.spec_rounds llama --model G --llama-server BIN --workloads quote,edit,summarise --out DIR
    python -m server.bench.spec_rounds report DIR [--plot server/bench/results/speculative_http.png]

`run`: per round, per workload, a fresh `cellserve serve --speculative auto` (plus `--auto-args`: a draft
model) and a fresh `--speculative off` (the order flips every round, so neither always runs first), each
measured at every client count with `cellserve bench serve` (closed loop, greedy, the same prompts for both
modes: the seed is the round's).
Every level writes the bench's JSON (`DIR/LABEL-WORKLOAD-MODE-cC-rR.json`) plus one line of `DIR/levels.jsonl`:
output tok/s (for `regen`: the regenerates' own tokens over their latency), the server's CPU seconds, drafted /
accepted tokens (from /metrics) and each request's output digest. `llama`: llama-server with
`--spec-type ngram-simple` and without, one client, the same prompts. `report`: per (file, workload,
clients) the auto / off ratios of each round, the share of drafted tokens kept, whether outputs matched;
with `--plot`, the chart (bars: mean auto / off; dots: rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server.bench.overhead import wait_healthy
from server.bench.regen import regen_rate
from server.bench.serve import main as bench_main
from server.bench.side_by_side import stop_server

SERVE = [str(Path(sys.executable).parent / "cellserve"), "serve"]
COPY = {"input_len": 100, "output_len": 300}  # words of passage / code; answers end at EOS
SHAPES = {"quote": COPY, "edit": COPY, "summarise": COPY, "regen": {"input_len": 16, "output_len": 128},
          "random": {"input_len": 64, "output_len": 128}}
# requests per level by client count (else 1 per client). One client runs 6: with 2 the figure was mostly
# those 2 prompts' (how much of their answers copies), 1.35 and 2.25 for `summarise` in two rounds.
REQUESTS = {1: 6, 8: 8, 32: 32}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spec_counts(url: str) -> tuple[float, float]:
    """(drafted, accepted) tokens so far, from the server's /metrics (prometheus_client's own parser); zeros
    from a server without them (llama-server answers 501 unless started with --metrics)."""
    try:
        r = httpx.get(f"{url}/metrics", timeout=10)
    except httpx.HTTPError:
        return 0.0, 0.0
    if r.status_code != 200:
        return 0.0, 0.0
    text = r.text
    got = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return (got.get("cellserve:spec_decode_num_draft_tokens_total", 0.0),
            got.get("cellserve:spec_decode_num_accepted_tokens_total", 0.0))


def start_server(cmd: list[str], url: str, log: Path) -> subprocess.Popen:
    """`cmd` started in its own process group (stop_server ends all of it), once healthy at `url`."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url, proc, log)
    except RuntimeError:
        stop_server(proc)
        raise
    return proc


def _bench_level(url: str, workload: str, clients: int, seed: int, out: Path) -> dict:
    shape = SHAPES[workload]
    argv = ["--url", url, "--workload", workload, "--concurrency", str(clients), "--seed", str(seed),
            "--num-requests", str(REQUESTS.get(clients, clients)), "--input-len", str(shape["input_len"]),
            "--output-len", str(shape["output_len"]), "--no-progress", "--out", str(out)]
    argv += ["--ignore-eos"] if workload == "random" else ["--endpoint", "chat"]
    rc = bench_main(argv)
    data = json.loads(out.read_text()) if out.exists() else None
    if rc != 0 or data is None or data["levels"][0]["summary"] is None:
        return {"error": f"bench exited {rc}"}
    lv = data["levels"][0]
    recs = lv["records"]
    timed = [r for r in recs if r["kind"] != "answer"]
    rate = lv["summary"]["output_throughput"]
    if workload == "regen":
        from server.bench.records import RequestRecord

        rate = regen_rate([RequestRecord.from_dict(r) for r in recs]) or 0.0
    return {"tok_s": rate, "tokens": sum(r["output_tokens"] for r in timed), "failed": lv["summary"]["failed"],
            "digests": {f"{r['index']}:{r['kind']}": r["output_digest"] for r in recs},
            "accepted_req": sum(r.get("accepted_draft_tokens") or 0 for r in timed),
            "rejected_req": sum(r.get("rejected_draft_tokens") or 0 for r in timed)}


def _one_server(args, cmd: list[str], meta: dict, workload: str, seed: int, out: Path) -> None:
    url = f"http://127.0.0.1:{args.port}"
    proc = start_server(cmd, url, out / f"server-{meta['label']}-{meta['mode']}.log")
    try:
        for clients in [int(c) for c in args.clients.split(",")]:
            d0, a0 = _spec_counts(url)
            cpu0 = _cpu_seconds(proc.pid)
            name = f"{meta['label']}-{workload}-{meta['mode']}-c{clients}-r{meta['round']}.json"
            row = _bench_level(url, workload, clients, seed, out / name)
            d1, a1 = _spec_counts(url)
            row.update(meta, workload=workload, clients=clients, server_cpu_s=_cpu_seconds(proc.pid) - cpu0,
                       drafted=d1 - d0, accepted=a1 - a0, load=os.getloadavg()[0], file=name, at=time.time())
            with (out / "levels.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{meta['label']} {workload} {meta['mode']} c={clients} r={meta['round']}: "
                  f"{row.get('tok_s', 0):.1f} tok/s, kept {a1 - a0:.0f}/{d1 - d0:.0f}, load {row['load']:.1f}",
                  flush=True)
    finally:
        stop_server(proc)


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for rnd in range(args.first_round, args.first_round + args.rounds):
        for workload in args.workloads.split(","):
            modes = ["auto", "off"] if rnd % 2 else ["off", "auto"]
            for mode in modes:
                cmd = [*SERVE, "--model", args.model, "--port", str(args.port), "--speculative", mode,
                       *shlex.split(args.serve_args), *(shlex.split(args.auto_args) if mode == "auto" else [])]
                meta = {"label": args.label, "mode": mode, "round": rnd, "server": shlex.join(cmd)}
                _one_server(args, cmd, meta, workload, args.seed + rnd, out)


def llama(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for rnd in range(args.first_round, args.first_round + args.rounds):
        for workload in args.workloads.split(","):
            for mode, extra in (("llama-ngram", ["--spec-type", "ngram-simple"]), ("llama-none", [])):
                serve = shlex.split(args.serve_args)  # the same thread count as cellserve's
                threads = serve[serve.index("--threads") + 1] if "--threads" in serve else "2"
                cmd = [args.llama_server, "-m", args.model, "--port", str(args.port), "-np", "8", "-c", "16384",
                       "-t", threads, "--no-repack", *extra]
                meta = {"label": args.label, "mode": mode, "round": rnd, "server": shlex.join(cmd)}
                _one_server(args, cmd, meta, workload, args.seed + rnd, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.bench.spec_rounds", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "llama"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True)
        s.add_argument("--label", default="model")
        s.add_argument("--workloads", default="quote,edit,summarise,regen")
        s.add_argument("--clients", default="1,8" if name == "run" else "1")
        s.add_argument("--rounds", type=int, default=2)
        s.add_argument("--first-round", type=int, default=1, help="number rounds from here (more rounds into a DIR)")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--port", type=int, default=8123)
        s.add_argument("--out", required=True)
        s.add_argument("--serve-args", default="--threads 2 --n-cells 16384 --max-num-batched-tokens 2048")
        if name == "run":
            s.add_argument("--auto-args", default="", help="more serve flags for the auto server only, e.g. "
                           "\"--draft-model smollm2-135m-instruct\" (off refuses a draft model)")
        s.add_argument("--llama-server", default=str(Path.home() / ".cache/cellserve-anchor/build/bin/llama-server"))
    r = sub.add_parser("report")
    r.add_argument("dir")
    r.add_argument("--plot")
    args = p.parse_args(argv)
    if args.cmd == "report":
        from server.bench.spec_report import report

        report(Path(args.dir), args.plot)
    else:
        (run if args.cmd == "run" else llama)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
