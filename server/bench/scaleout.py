"""Scale-out measured in one run: the single server against `--replicas` layouts, alternating.

    python -m server.bench.scaleout --rounds 2 --out scaleout.json

Each round starts every layout in turn (the order rotates from round to round, so a noisy neighbour
hits them alike), as a fresh `cellserve serve` process on 127.0.0.1, and for each:
1. probes the fixed cost of a request: sequential `GET /v1/models` (no engine work: the HTTP path and,
   with `--replicas`, Serve's proxy and the Ray hop to the replica) and sequential 1-token
   completions, client latency p50/p90, and the CPU time of the `cellserve` process (for `--replicas`:
   the launching process, which only waits) per request;
2. warms the engine up, then runs `cellserve bench serve` (closed loop, streaming, EOS ignored) at
   each concurrency, recording output tokens/s, TTFT and the CPU time per request of the `cellserve`
   process and of every process it started (Ray's and the replicas' included);
3. stops it with SIGTERM and checks that none of the processes it started is left (any that is, is
   killed by pid and reported).
It prints one table per round with each layout's tokens/s relative to the first layout of the list
(the single server by default). Without `--model` the 56M-parameter benchmark Llama is saved first.
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
from server.bench.overhead import bench_model

TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stat(pid: int, tid: int | None = None) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (s := stat(int(entry))) is not None:
            parent[int(entry)] = int(s[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def cpu_s(pids: set[int]) -> float:
    """utime + stime of these processes (their threads included), seconds."""
    total = 0
    for p in pids:
        if (s := stat(p)) is not None:
            total += int(s[11]) + int(s[12])
    return total / TICK


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if (s := stat(p)) is not None and s[0] != "Z"}


def parse_layout(text: str) -> tuple[int | None, int]:
    """'single:2' -> (None, 2) (plain server, 2 threads); '2x1' -> (2 replicas, 1 thread each)."""
    if text.startswith("single:"):
        return None, int(text.split(":", 1)[1])
    n, t = text.split("x")
    return int(n), int(t)


class Server:
    def __init__(self, args: argparse.Namespace, model: str, layout: str, log: Path):
        replicas, threads = parse_layout(layout)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        n_cells = max(args.concurrency_list) * (args.input_len + 1 + args.output_len) + 256
        cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model, "--dtype", args.dtype,
               "--port", str(self.port), "--n-cells", str(n_cells), "--max-num-batched-tokens", "2048",
               "--log-level", "warning", "--shutdown-grace", "5"]
        cmd += ["--threads", str(threads)] if replicas is None else [
            "--replicas", str(replicas), "--threads-per-replica", str(threads)]
        self.log = log
        with log.open("w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.started: set[int] = set()

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited {self.proc.returncode} while loading; see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    self.started = descendants(self.proc.pid)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"not healthy within {timeout_s:.0f} s; see {self.log}")

    def cpu(self) -> tuple[float, float, float]:
        """CPU s of: the cellserve process; its main thread (the ingress's event loop: the part that cannot
        spread over cores); it and every process it started."""
        own = cpu_s({self.proc.pid})
        main = (int(s[11]) + int(s[12])) / TICK if (s := stat(self.proc.pid, self.proc.pid)) else 0.0
        return own, main, own + cpu_s(self.started | descendants(self.proc.pid))

    def stop(self) -> dict:
        started = self.started | descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own process group: only what this run started
            rc = self.proc.wait(10)
        deadline = time.monotonic() + 30
        while (left := alive(started)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for p in left:
            os.kill(p, signal.SIGKILL)
        return {"exit_status": rc, "left_behind": sorted(left)}


def probe(server: Server, n: int) -> dict:
    """Sequential tiny requests: client latency and the cellserve process's CPU per request."""
    out = {}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        calls = {"models": lambda: c.get("/v1/models"),
                 "completion_1tok": lambda: c.post("/v1/completions", json={
                     "model": model, "prompt": "hello", "max_tokens": 1, "temperature": 0})}
        for name, call in calls.items():
            for _ in range(10):  # warm-up
                call().raise_for_status()
            lat = []
            before = server.cpu()
            for _ in range(n):
                t = time.perf_counter()
                call().raise_for_status()
                lat.append(time.perf_counter() - t)
            own, main, every = (1e3 * (b - a) / n for a, b in zip(before, server.cpu()))
            lat.sort()
            out[name] = {"p50_ms": 1e3 * lat[len(lat) // 2], "p90_ms": 1e3 * lat[int(len(lat) * 0.9)],
                         "proc_cpu_ms": own, "main_thread_cpu_ms": main, "all_cpu_ms": every}
    return out


def bench_level(args: argparse.Namespace, server: Server, work: Path, tag: str, concurrency: int,
                requests: int, output_len: int, seed: int) -> dict:
    out = work / f"{tag}.json"
    cmd = [sys.executable, "-m", "server.bench", "serve", "--url", server.url, "--concurrency", str(concurrency),
           "--num-requests", str(requests), "--input-len", str(args.input_len), "--output-len", str(output_len),
           "--ignore-eos", "--seed", str(seed), "--no-progress", "--out", str(out)]
    if args.duration:
        cmd += ["--duration", str(args.duration)]
    before = server.cpu()
    with (work / f"{tag}.log").open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    own, main, every = (b - a for a, b in zip(before, server.cpu()))
    if rc != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {rc}; see {work / tag}.log")
    s = json.loads(out.read_text())["levels"][0]["summary"]
    done = max(1, s["completed"])
    return {"tok_s": s["output_throughput"], "req_s": s["request_throughput"], "completed": s["completed"],
            "failed": s["failed"], "errors": s["errors"], "ttft_p50_ms": s["ttft"]["p50"],
            "ttft_p99_ms": s["ttft"]["p99"], "itl_p50_ms": s["itl"]["p50"],
            "proc_cpu_ms_per_req": 1e3 * own / done, "main_thread_cpu_ms_per_req": 1e3 * main / done,
            "all_cpu_ms_per_req": 1e3 * every / done, "proc_cpu_share": own / s["duration_s"],
            "main_thread_cpu_share": main / s["duration_s"], "tokens": s["total_output_tokens"]}


def run_layout(args: argparse.Namespace, model: str, layout: str, work: Path, k: int) -> dict:
    tag = f"r{k}-{layout.replace(':', '')}"
    server = Server(args, model, layout, work / f"{tag}-serve.log")
    t0 = time.monotonic()
    try:
        server.wait_healthy()
        row = {"layout": layout, "round": k, "ready_s": time.monotonic() - t0, "probe": probe(server, args.probe)}
        bench_level(args, server, work, f"{tag}-warmup", 8, 16, 16, 1000 + k)
        row["levels"] = {c: bench_level(args, server, work, f"{tag}-c{c}", c, args.num_requests, args.output_len, k)
                         for c in args.concurrency_list}
    finally:
        row_stop = server.stop()
    return {**row, **row_stop}


def print_round(rows: list[dict], layouts: list[str], levels: list[int]) -> None:
    base = next(r for r in rows if r["layout"] == layouts[0])
    print(f"round {rows[0]['round']}: output tok/s (x {layouts[0]}), TTFT p50 ms, CPU ms/request of the cellserve "
          f"process / its main thread")
    for r in sorted(rows, key=lambda r: layouts.index(r["layout"])):
        cells = []
        for c in levels:
            lv, b = r["levels"][c], base["levels"][c]
            cells.append(f"c{c}: {lv['tok_s']:6.1f} ({lv['tok_s'] / b['tok_s']:.2f}x) {lv['ttft_p50_ms']:6.0f} "
                         f"{lv['proc_cpu_ms_per_req']:5.1f}{' FAILED ' + str(lv['failed']) if lv['failed'] else ''}")
        p = r["probe"]
        print(f"  {r['layout']:>9}  " + " | ".join(cells))
        print(f"  {'':>9}  /v1/models p50 {p['models']['p50_ms']:.2f} ms cpu {p['models']['proc_cpu_ms']:.2f}/{p['models']['main_thread_cpu_ms']:.2f} ms; "
              f"1-token completion p50 {p['completion_1tok']['p50_ms']:.2f} ms cpu "
              f"{p['completion_1tok']['proc_cpu_ms']:.2f}/{p['completion_1tok']['main_thread_cpu_ms']:.2f} ms; ready in {r['ready_s']:.0f} s; exit {r['exit_status']}"
              f"{'; LEFT BEHIND ' + str(r['left_behind']) if r['left_behind'] else ''}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.bench.scaleout", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="local HF folder (default: the 56M benchmark Llama, saved to a temp folder)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layouts", default="single:2,1x2,2x1",
                   help="'single:T' = plain server with T threads, 'NxT' = N replicas x T threads")
    p.add_argument("--concurrency", default="8,32,64")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--duration", type=float, default=30.0, help="per level: stop issuing requests after this")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--probe", type=int, default=200, help="sequential tiny requests per probe kind")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--work-dir", help="keep every log and JSON here (default: a temporary folder)")
    p.add_argument("--out", help="write every row as JSON")
    args = p.parse_args(argv)
    args.concurrency_list = [int(c) for c in args.concurrency.split(",")]
    layouts = args.layouts.split(",")
    print("command: python -m server.bench.scaleout", shlex.join(sys.argv[1:] if argv is None else argv))
    print("machine:", machine_info(), flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="cellserve-scaleout-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = bench_model(args.model, work)
        for k in range(args.rounds):
            order = layouts[k % len(layouts):] + layouts[:k % len(layouts)]
            this_round = [run_layout(args, model, layout, work, k) for layout in order]
            rows += this_round
            print_round(this_round, layouts, args.concurrency_list)
            if args.out:
                Path(args.out).write_text(json.dumps({"argv": argv, "machine": machine_info(), "rows": rows}, indent=1))
    for layout in layouts:
        for c in args.concurrency_list:
            ratios = [r["levels"][c]["tok_s"] / b["levels"][c]["tok_s"] for k in range(args.rounds)
                      for r in rows for b in rows
                      if r["round"] == b["round"] == k and r["layout"] == layout and b["layout"] == layouts[0]]
            print(f"median {layout} / {layouts[0]} at {c} clients: {statistics.median(ratios):.2f}x "
                  f"({', '.join(f'{x:.2f}' for x in ratios)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
