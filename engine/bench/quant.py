"""A GGUF served quantized against the same file dequantized to bf16 and to float32, in one run.

    python -m engine.bench.quant [--model smollm2-135m-instruct] [--threads 1,2] [--repeats 3]
                                 [--seqs 8,32] [--prefill 8x128] [--paths quantized,tiles,bfloat16,float32]

For each path (`quantized`: the file's own blocks, engine/model/native/quant.py, many rows on the
integer GEMM; `tiles`: the same blocks with the GEMM off (`QuantLinear.gemm = False`: past the row kernel's rows, 3 (K-quants 8)
through fp32 tiles + torch.mm, the path before it), the A/B baseline; `bfloat16` and `float32`: the
converted folders) and each thread count: one-sequence decode tok/s (a 64-token prompt, then
`--max-tokens` greedy tokens, EOS ignored; the decode rate from the first token to the last, the
prefill left out), N-sequence tok/s for each N of `--seqs` (N such requests at once, every generated
token over the whole wall time, prefill included) and prefill tok/s (`--prefill PxL`: P prompts of L
tokens at once, one token generated each; prompt tokens over the wall time). The paths' runners live in
this process and run alternately, `--repeats` times, best kept; speculative decoding and prefix caching
are off. Then the weights' bytes (what the native forward holds: `quant.weight_bytes`) and the peak RSS
of a fresh process that loads only that one path and runs one 8-sequence round (`--rss-only PATH`, one
process each, same cell budget; `tiles` holds the same weights as `quantized`, not measured again).
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
from engine.model.native.quant import GroupLinear, QuantLinear, weight_bytes
from engine.model.runner import ModelRunner

PATHS = ("quantized", "tiles", "bfloat16", "float32")
N_CELLS = 4608  # 32 sequences of 64 + 64 tokens, and room


def load(model: str, path: str) -> ModelRunner:
    folder = resolve_model(model, "quantized" if path == "tiles" else path, progress=False).path
    runner = ModelRunner.from_pretrained(folder, dtype=path if path in ("bfloat16", "float32") else "auto",
                                         n_cells=N_CELLS)
    if path == "tiles":
        for lin in _quant_linears(runner.native):
            lin.gemm = False
    return runner


def _quant_linears(native) -> list[QuantLinear]:
    out = []
    for lin in [native.head, *(lin for layer in native.layers for lin in layer.linears())]:
        out += [p for p in (lin.parts if isinstance(lin, GroupLinear) else [lin]) if isinstance(p, QuantLinear)]
    return out


def run(runner: ModelRunner, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """(tok/s, tokens): one request -> its decode rate after the first token; several -> all over wall;
    `max_tokens` 1 -> prompt tokens over wall (the prefill rate)."""
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
    if max_tokens == 1:
        return sum(len(p) for p in prompts) / wall, tokens
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
    p.add_argument("--seqs", default="8", help="sequence counts decoded at once, besides 1")
    p.add_argument("--prefill", default="8x128", help="PROMPTSxTOKENS prefilled at once (one token generated)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"a subset of {','.join(PATHS)} (bfloat16 is the base)")
    p.add_argument("--no-rss", action="store_true", help="skip the one-process-per-path memory measurement")
    p.add_argument("--rss-only", choices=PATHS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_only:
        torch.set_num_threads(int(args.threads.split(",")[-1]))
        rss_only(args.model, args.rss_only, args.max_tokens)
        return 0
    paths = [q for q in PATHS if q in args.paths.split(",")]
    if "bfloat16" not in paths:
        p.error("--paths must include bfloat16, the base of the ratios")
    print("command:", shlex.join([sys.executable, "-m", "engine.bench.quant", *(argv or sys.argv[1:])]))
    mem = {} if args.no_rss else _memory(args, [q for q in paths if q != "tiles"])
    runners = {path: load(args.model, path) for path in paths}
    vocab = runners["bfloat16"].config.vocab_size
    n_pre, len_pre = (int(v) for v in args.prefill.split("x"))
    loads = {"1 seq": (prompts_for(1, 64, seed=1, vocab_size=vocab), args.max_tokens)}
    for n in (int(v) for v in args.seqs.split(",") if v):
        loads[f"{n} seq"] = (prompts_for(n, 64, seed=2, vocab_size=vocab), args.max_tokens)
    loads[f"prefill {n_pre}x{len_pre}"] = (prompts_for(n_pre, len_pre, seed=4, vocab_size=vocab), 1)
    results: dict[tuple[int, str, str], float] = {}
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        print("machine:", machine(), "| load average", _load(), flush=True)
        for _ in range(args.repeats):
            for path in paths:  # alternating, so a noisy moment hits every path alike
                for name, (prompts, max_tokens) in loads.items():
                    rate, _ = run(runners[path], prompts, max_tokens)
                    key = (threads, name, path)
                    results[key] = max(results.get(key, 0.0), rate)
                    print(f"  {threads} threads, {path}, {name}: {rate:.1f} tok/s", flush=True)
    print(f"\nmodel {args.model}; decode: prompts of 64 tokens, {args.max_tokens} generated (greedy, EOS "
          f"ignored); prefill: prompt tok/s; best of {args.repeats}, paths alternating; x = against bfloat16 "
          "in this run")
    print(f"{'path':10} {'threads':>7} " + " ".join(f"{name + ' tok/s':>20} {'x':>5}" for name in loads))
    for threads in (int(t) for t in args.threads.split(",")):
        for path in paths:
            cells = []
            for name in loads:
                r, b = results[(threads, name, path)], results[(threads, name, "bfloat16")]
                cells.append(f"{r:20.1f} {r / b:5.2f}")
            print(f"{path:10} {threads:7d} " + " ".join(cells))
    if mem:
        _print_memory(mem)
    print("load average after:", _load())
    return 0


def _memory(args, paths: list[str]) -> dict:
    mem = {}
    for path in paths:  # one fresh process each: its peak RSS is that path's alone
        cmd = [sys.executable, "-m", "engine.bench.quant", "--model", args.model, "--rss-only", path,
               "--threads", args.threads.split(",")[-1], "--max-tokens", str(args.max_tokens)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        mem[path] = json.loads(out.strip().splitlines()[-1])
    return mem


def _print_memory(mem: dict) -> None:
    print(f"\n{'path':10} {'weights MB':>10} {'x':>6} {'peak RSS MB':>12} {'x':>6}   (one process per path, "
          f"{N_CELLS} cells)")
    for path, m in mem.items():
        w, r = m["weights"], m["peak_rss"]
        bw, br = mem["bfloat16"]["weights"], mem["bfloat16"]["peak_rss"]
        print(f"{path:10} {w / 1e6:10.1f} {w / bw:6.2f} {r / 1e6:12.1f} {r / br:6.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
