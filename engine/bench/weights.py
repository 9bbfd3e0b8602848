"""One copy of a float model's weights against the old two-copy layout, in one run: speed and peak RSS.

    python -m engine.bench.weights [--model smollm2-135m-instruct] [--dtypes float32,bfloat16]
                                   [--threads 2] [--repeats 3] [--seqs 8,32] [--prefill 8x128]

For each dtype, two runners of the same converted folder: `one` (the default: each linear keeps only its
oneDNN-packed weight, which one-row calls read through `packed_linear`; the transformers modules' weights
released; a tied embedding looked up in the head's packed copy) and `two` (`CELLSERVE_WEIGHT_COPIES=2` at
load: the plain weights kept beside the packed ones for `small_linear`, and the modules' weights kept, as
before). Both run alternately, `--repeats` times, best kept: one-sequence decode tok/s, N-sequence tok/s
and prefill tok/s (as engine/bench/quant.py measures them; speculative decoding and prefix caching off).
Then the peak RSS (VmHWM, the load's transient included) and the RSS after (VmRSS: what serving holds) of a
fresh process per (dtype, layout) that loads it and runs one 8-sequence round. Ratios: one / two, measured in the same run.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys

import torch

from engine.bench.common import prompts_for
from engine.bench.machine import machine
from engine.bench.quant import N_CELLS, _load, run
from engine.loader.source import resolve_model
from engine.model.native.quant import weight_bytes
from engine.model.runner import ModelRunner

LAYOUTS = ("one", "two")


def load(model: str, dtype: str, layout: str) -> ModelRunner:
    folder = resolve_model(model, dtype, progress=False).path
    old = os.environ.pop("CELLSERVE_WEIGHT_COPIES", None)
    if layout == "two":
        os.environ["CELLSERVE_WEIGHT_COPIES"] = "2"
    try:
        return ModelRunner.from_pretrained(folder, dtype=dtype, n_cells=N_CELLS)
    finally:
        os.environ.pop("CELLSERVE_WEIGHT_COPIES", None)
        if old is not None:
            os.environ["CELLSERVE_WEIGHT_COPIES"] = old


def rss_only(model: str, dtype: str, layout: str) -> None:
    """Load one (dtype, layout), run one 8-sequence round, print a JSON line with the peak RSS."""
    runner = load(model, dtype, layout)
    run(runner, prompts_for(8, 64, seed=3, vocab_size=runner.config.vocab_size), 16)
    with open("/proc/self/status") as f:
        status = f.read()
    peak = int(status.split("VmHWM:")[1].split()[0]) * 1024  # the load's transient included
    now = int(status.split("VmRSS:")[1].split()[0]) * 1024  # after the load and the round: what serving holds
    params = sum(p.numel() * p.element_size() for p in runner.model.parameters() if p.untyped_storage().nbytes() > p.element_size())
    print(json.dumps({"dtype": dtype, "layout": layout, "peak_rss": peak, "rss": now, "native_weights": weight_bytes(runner.native),
                      "module_weights": params}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.weights", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a known model name, a .gguf or a folder")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seqs", default="8,32", help="sequence counts decoded at once, besides 1")
    p.add_argument("--prefill", default="8x128", help="PROMPTSxTOKENS prefilled at once (one token generated)")
    p.add_argument("--no-rss", action="store_true")
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--rss-only", nargs=2, metavar=("DTYPE", "LAYOUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.rss_only:
        rss_only(args.model, *args.rss_only)
        return 0
    dtypes = args.dtypes.split(",")
    print("command:", shlex.join([sys.executable, "-m", "engine.bench.weights", *(argv or sys.argv[1:])]))
    print("machine:", machine(), "| load average", _load(), flush=True)
    if not args.no_rss:
        print(f"\n{'dtype':10} {'layout':6} {'peak RSS MB':>12} {'x':>6} {'RSS after MB':>13} {'x':>6} "
              f"{'native weights MB':>18} {'module weights MB':>18}   (one fresh process each, one 8-sequence round)")
        for dtype in dtypes:
            mem = {}
            for layout in LAYOUTS:
                cmd = [sys.executable, "-m", "engine.bench.weights", "--model", args.model, "--threads",
                       str(args.threads), "--rss-only", dtype, layout]
                mem[layout] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True)
                                         .stdout.strip().splitlines()[-1])
            for layout, m in mem.items():
                print(f"{dtype:10} {layout:6} {m['peak_rss'] / 1e6:12.1f} {m['peak_rss'] / mem['two']['peak_rss']:6.2f} "
                      f"{m['rss'] / 1e6:13.1f} {m['rss'] / mem['two']['rss']:6.2f} "
                      f"{m['native_weights'] / 1e6:18.1f} {m['module_weights'] / 1e6:18.1f}", flush=True)
    if args.no_speed:
        return 0
    n_pre, len_pre = (int(v) for v in args.prefill.split("x"))
    for dtype in dtypes:
        runners = {layout: load(args.model, dtype, layout) for layout in LAYOUTS}
        vocab = runners["one"].config.vocab_size
        loads = {"1 seq": (prompts_for(1, 64, seed=1, vocab_size=vocab), args.max_tokens)}
        for n in (int(v) for v in args.seqs.split(",") if v):
            loads[f"{n} seq"] = (prompts_for(n, 64, seed=2, vocab_size=vocab), args.max_tokens)
        loads[f"prefill {n_pre}x{len_pre}"] = (prompts_for(n_pre, len_pre, seed=4, vocab_size=vocab), 1)
        best: dict[tuple[str, str], float] = {}
        for _ in range(args.repeats):
            for name, (prompts, max_tokens) in loads.items():
                for layout in LAYOUTS:  # alternating, so a noisy moment hits both alike
                    rate, _ = run(runners[layout], prompts, max_tokens)
                    best[(name, layout)] = max(best.get((name, layout), 0.0), rate)
                    print(f"  {dtype}, {layout} copy, {name}: {rate:.1f} tok/s", flush=True)
        print(f"\n{dtype}: best of {args.repeats}, alternating; x = one / two")
        for name in loads:
            one, two = best[(name, "one")], best[(name, "two")]
            print(f"  {name:16} one {one:8.1f} tok/s   two {two:8.1f} tok/s   x {one / two:5.2f}")
        del runners
    print("load average after:", _load())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
