"""A GGUF served quantized against the same file dequantized to bf16 and to float32, in one run.

    python -m engine.bench.quant [--model smollm2-135m-instruct] [--threads 1,2] [--repeats 3]

For each path (`quantized`: the file's own blocks, engine/model/native/quant.py; `bfloat16` and
`float32`: the converted folders) and each thread count: one-sequence decode tok/s (a 64-token prompt,
then `--max-tokens` greedy tokens, EOS ignored; the decode rate from the first token to the last, the
prefill left out) and 8-sequence tok/s (8 such requests at once, every generated token over the whole
wall time, prefill included). The three paths' runners live in this process and run alternately,
`--repeats` times, best kept; speculative decoding and prefix caching are off. Then the weights' bytes
(what the native forward holds: `quant.weight_bytes`) and the peak RSS of a fresh process that loads
only that one path and runs one 8-sequence round (`--rss-only PATH`, one process each, same cell budget).
Ratios are against the bf16 path measured in the same run.
"""

import argparse
import json
import resource
import shlex
import subprocess
import sys
import time

import torch

from engine.api.args import EngineArgs
from engine.api.sampling_params import SamplingParams
from engine.bench.common import prompts_for
from engine.bench.machine import machine, machine_info
from engine.core.engine import Engine
from engine.loader.source import resolve_model
from engine.model.native.quant import weight_bytes
from engine.model.runner import ModelRunner

PATHS = ("quantized", "bfloat16", "float32")
N_CELLS = 2048


def load(model: str, path: str) -> ModelRunner:
    folder = resolve_model(model, path, progress=False).path
    return ModelRunner.from_pretrained(folder, dtype=path if path != "quantized" else "auto", n_cells=N_CELLS)


def run(runner: ModelRunner, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """(tok/s, tokens): one request -> its decode rate after the first token; several -> all over wall."""
    engine = Engine(runner, EngineArgs(speculative="off", prefix_caching=False))
    stamps: dict[str, list[float]] = {}

    def sink(rid):
        return lambda out: stamps.setdefault(rid, []).extend([time.perf_counter()] * len(out.outputs[0].token_ids))

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, sink(f"r{i}"), detokenize=False)
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t0
    tokens = sum(len(s) for s in stamps.values())
    if len(prompts) == 1:
        s = stamps["r0"]
        return (len(s) - 1) / (s[-1] - s[0]), tokens
    return tokens / wall, tokens


def rss_only(model: str, path: str, max_tokens: int) -> None:
    """Load one path, run one 8-sequence round, print a JSON line with the weights' bytes and peak RSS."""
    runner = load(model, path)
    vocab = runner.config.vocab_size
    run(runner, prompts_for(8, 64, seed=3, vocab_size=vocab), max_tokens)
    # VmHWM: this process's own high-water mark (ru_maxrss keeps the parent's across fork and exec)
    with open("/proc/self/status") as f:
        status = f.read().split("VmHWM:")[1].split()
    peak = int(status[0]) * 1024 if status[1] == "kB" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"path": path, "weights": weight_bytes(runner.native), "peak_rss": peak}))


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in machine_info()["load_average"] or ())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.quant", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a known model name or a quantized .gguf")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rss-only", choices=PATHS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_only:
        torch.set_num_threads(int(args.threads.split(",")[-1]))
        rss_only(args.model, args.rss_only, args.max_tokens)
        return 0
    print("command:", shlex.join([sys.executable, "-m", "engine.bench.quant", *(argv or sys.argv[1:])]))
    mem = {}
    for path in PATHS:  # one fresh process each: its peak RSS is that path's alone
        cmd = [sys.executable, "-m", "engine.bench.quant", "--model", args.model, "--rss-only", path,
               "--threads", args.threads.split(",")[-1], "--max-tokens", str(args.max_tokens)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        mem[path] = json.loads(out.strip().splitlines()[-1])
    runners = {path: load(args.model, path) for path in PATHS}
    vocab = runners["quantized"].config.vocab_size
    one, eight = prompts_for(1, 64, seed=1, vocab_size=vocab), prompts_for(8, 64, seed=2, vocab_size=vocab)
    results: dict[tuple[int, str, str], float] = {}
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        print("machine:", machine(), "| load average", _load(), flush=True)
        for _ in range(args.repeats):
            for path in PATHS:  # alternating, so a noisy moment hits every path alike
                for name, prompts in (("1 seq", one), ("8 seq", eight)):
                    rate, _ = run(runners[path], prompts, args.max_tokens)
                    key = (threads, name, path)
                    results[key] = max(results.get(key, 0.0), rate)
    print(f"\nmodel {args.model}; prompts of 64 tokens, {args.max_tokens} generated (greedy, EOS ignored); "
          f"best of {args.repeats}, paths alternating; x = against bfloat16 in this run")
    print(f"{'path':10} {'threads':>7} {'1 seq tok/s':>12} {'x':>6} {'8 seq tok/s':>12} {'x':>6}")
    for threads in (int(t) for t in args.threads.split(",")):
        for path in PATHS:
            r1, r8 = results[(threads, "1 seq", path)], results[(threads, "8 seq", path)]
            b1, b8 = results[(threads, "1 seq", "bfloat16")], results[(threads, "8 seq", "bfloat16")]
            print(f"{path:10} {threads:7d} {r1:12.1f} {r1 / b1:6.2f} {r8:12.1f} {r8 / b8:6.2f}")
    print(f"\n{'path':10} {'weights MB':>10} {'x':>6} {'peak RSS MB':>12} {'x':>6}   (one process per path, "
          f"{N_CELLS} cells)")
    for path in PATHS:
        w, r = mem[path]["weights"], mem[path]["peak_rss"]
        bw, br = mem["bfloat16"]["weights"], mem["bfloat16"]["peak_rss"]
        print(f"{path:10} {w / 1e6:10.1f} {w / bw:6.2f} {r / 1e6:12.1f} {r / br:6.2f}")
    print("load average after:", _load())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
