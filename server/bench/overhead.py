"""`cellserve bench overhead`: what the HTTP server keeps of the offline engine's throughput, in one run.

Each pair runs the same closed-loop workload (C clients, R requests, P-token prompts, O tokens each,
EOS ignored, one model folder, one dtype, one torch thread count) twice, back to back:
1. offline: `cellserve bench engine --requests R --concurrency C` (the Engine driven in-process);
2. server: a fresh `cellserve serve` process on 127.0.0.1 with the offline run's engine settings,
   loaded by `cellserve bench serve` (streaming, a separate process like any client on this machine).
It prints the command, the machine, each pair's tokens/s and server/offline ratio, and the median
ratio. Pairs alternate so that a noisy neighbour slows both sides of a pair alike; read the median.
Without `--model` the 56M-parameter benchmark Llama (random weights, 32k-word tokenizer) is saved to
a temporary folder first. Every process is started here and ended here, by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine.bench.machine import machine_info

HEALTH_TIMEOUT_S = 300.0
BENCH_ENGINE = [sys.executable, "-m", "server.cli", "bench", "engine"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_model(model: str | None, work: Path) -> str:
    """`model`, or else the 56M-parameter benchmark model (random weights) saved once into `work`."""
    if model is not None:
        return model
    path = str(work / "bench56m")
    _run([*BENCH_ENGINE, "--save-model", path], work / "save_model.log")
    return path


def _run(cmd: list[str], log: Path) -> None:
    with log.open("w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {done.returncode}; see {log}")


def offline_tok_s(args: argparse.Namespace, model: str, work: Path, k: int) -> float:
    out = work / f"offline_{k}.json"
    _run([*BENCH_ENGINE, "--model", model, "--dtype", args.dtype,
          "--threads", str(args.threads), "--concurrency", str(args.concurrency), "--requests", str(args.requests),
          "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len), "--hf-cb", "",
          "--generate-requests", "1", "--json", str(out)], work / f"offline_{k}.log")
    rows = json.loads(out.read_text())["rows"]
    return next(r["tok_s"] for r in rows if r["system"].startswith("cellserve"))


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode} while loading; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not become healthy within {HEALTH_TIMEOUT_S:.0f} s; see {log}")


def server_tok_s(args: argparse.Namespace, model: str, work: Path, k: int) -> float:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # the offline run's engine settings (engine/bench/engine.py run_cellserve): a pool that holds every request
    # in flight, full batches; the rest are the defaults both sides take from EngineArgs
    n_cells = args.concurrency * (args.prompt_len + 1 + args.output_len) + 64
    log = work / f"server_{k}.log"
    serve = [sys.executable, "-m", "server.cli", "serve", "--model", model, "--dtype", args.dtype,
             "--threads", str(args.threads), "--port", str(port), "--n-cells", str(n_cells),
             "--max-num-batched-tokens", "2048", "--log-level", "warning"]
    with log.open("w") as f:
        proc = subprocess.Popen(serve, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, log)
        out = work / f"server_{k}.json"
        _run([sys.executable, "-m", "server.bench", "serve", "--url", url, "--concurrency", str(args.concurrency),
              "--num-requests", str(args.requests), "--input-len", str(args.prompt_len),
              "--output-len", str(args.output_len), "--ignore-eos", "--seed", str(k), "--no-progress",
              "--out", str(out)], work / f"client_{k}.log")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    summary = json.loads(out.read_text())["levels"][0]["summary"]
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed against the server; see {work}")
    return summary["output_throughput"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cellserve bench overhead", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="local HF folder (default: the 56M benchmark Llama, saved to a temp folder)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=2, help="torch threads, offline and in the server")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--pairs", type=int, default=3, help="offline/server pairs to run (the median ratio is kept)")
    p.add_argument("--work-dir", help="keep every log and JSON here (default: a temporary folder)")
    p.add_argument("--out", help="write the pairs and the median ratio here as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    print("command: cellserve bench overhead", shlex.join(argv))
    print("machine:", machine_info())
    with tempfile.TemporaryDirectory(prefix="cellserve-overhead-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = bench_model(args.model, work)
        pairs = []
        print(f"{'pair':>4} {'offline tok/s':>14} {'server tok/s':>13} {'server/offline':>15}", flush=True)
        for k in range(args.pairs):
            offline = offline_tok_s(args, model, work, k)
            served = server_tok_s(args, model, work, k)
            pairs.append({"offline_tok_s": offline, "server_tok_s": served, "ratio": served / offline})
            print(f"{k:4d} {offline:14.1f} {served:13.1f} {served / offline:15.1%}", flush=True)
        median = statistics.median(p["ratio"] for p in pairs)
        print(f"median server/offline: {median:.1%} over {len(pairs)} pairs "
              f"(concurrency {args.concurrency}, {args.dtype}, {args.threads} torch threads, {os.cpu_count()} CPUs)")
        if args.out:
            Path(args.out).write_text(json.dumps({"command": argv, "machine": machine_info(), "pairs": pairs,
                                                  "median_ratio": median}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
