"""`--quantize int8` / `int4` against float32 and bfloat16 of the same float folder, in one run.

    python -m engine.bench.quantize [--model smollm2-135m-instruct] [--threads 2] [--repeats 3]
    python -m engine.bench.quantize --perplexity TEXT [--tokens 1000] [--rows 8] [--model ...]

`--model`: a float Hugging Face folder, or a known model name (its GGUF dequantized to a float32 folder
once: `cellserve pull NAME --dtype float32`). Paths: `float32` (the folder as saved), `bfloat16` (cast at
load), `int8` and `int4` (quantized at load, engine/loader/quantize.py). For each: one-sequence decode
tok/s and 8-sequence tok/s (`engine.bench.quant.run`: 64-token prompts, `--max-tokens` greedy tokens, EOS
ignored; the one-sequence rate from its first token to its last, the 8-sequence rate every token over the
wall time), the paths' runners alternating `--repeats` times in this process, best kept, speculative
decoding and prefix caching off. Then bytes: the decoder linears' (q/k/v/o, gate/up/down: the blocks, or
the float weights at 4 or 2 bytes each), everything the native forward holds (`quant.weight_bytes`: float
paths keep their weights plus oneDNN's packed copy) and the peak RSS of a fresh process that loads only
that path and runs one 8-sequence round (`--rss-only`). Ratios against float32 in the same run.

`--perplexity TEXT`: instead, the perplexity of the first `--tokens` tokens of the file TEXT (in windows of
at most 500) through the engine (prompt logprobs, `--rows` prompt rows a step) for float32 and for each
(linears, head) pair of block formats in `VARIANTS`: how int4's format and the head's were chosen.
"""

import argparse
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from engine.bench.common import prompts_for
from engine.bench.machine import machine, machine_info
from engine.bench.quant import run
from engine.loader.source import resolve_model
from engine.model.native.quant import QuantLinear, weight_bytes
from engine.model.runner import ModelRunner

PATHS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"), "int8": ("float32", "int8"),
         "int4": ("float32", "int4")}  # path -> (dtype, quantize)
N_CELLS = 2048
# (linears, LM head) block formats the perplexity comparison runs; None: float32
VARIANTS = (("q8_0", "q8_0"), ("q8_0", None), ("q4_1", "q8_0"), ("q4_1", "q4_1"), ("q4_1", None),
            ("q4_0", "q8_0"), ("q4_0", "q4_0"))


def load(model: str, path: str) -> ModelRunner:
    folder = resolve_model(model, "float32", progress=False).path
    dtype, quantize = PATHS[path]
    return ModelRunner.from_pretrained(folder, dtype=dtype, quantize=quantize, n_cells=N_CELLS)


def linear_bytes(runner: ModelRunner) -> int:
    """Bytes of the decoder layers' linears: the blocks when quantized, else the float weights."""
    total = 0
    for layer in runner.native.layers:
        for lin in {id(x): x for x in layer.linears()}.values():
            if isinstance(lin, QuantLinear):
                total += lin.weight.nbytes
            else:
                total += lin.out_features * lin.in_features * torch.empty((), dtype=runner.dtype).element_size()
    return total


def rss_only(model: str, path: str, max_tokens: int) -> None:
    """Load one path, run one 8-sequence round, print its bytes and peak RSS (VmHWM) as a JSON line."""
    runner = load(model, path)
    run(runner, prompts_for(8, 64, seed=3, vocab_size=runner.config.vocab_size), max_tokens)
    with open("/proc/self/status") as f:
        kb = int(f.read().split("VmHWM:")[1].split()[0])
    print(json.dumps({"path": path, "linears": linear_bytes(runner), "weights": weight_bytes(runner.native),
                      "peak_rss": kb * 1024}))


def perplexity(runner: ModelRunner, ids: list[int], rows: int) -> float:
    from engine.api.sampling_params import SamplingParams
    from engine.core.llm import LLM

    llm = LLM(None, runner=runner, max_num_batched_tokens=rows, prefix_caching=False, speculative="off")
    windows = [ids[i:i + 500] for i in range(0, len(ids), 500)]
    outs = llm.generate(windows, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    logprobs = [lp for out in outs for lp in out.prompt_logprobs.logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def compare_formats(model: str, text: str, tokens: int, rows: int) -> None:
    from engine.loader.quantize import load_quantized_folder
    from engine.model.native.model import native_unsupported

    folder = resolve_model(model, "float32", progress=False).path
    base = ModelRunner.from_pretrained(folder, dtype="float32", n_cells=1024)
    ids = base.tokenizer(Path(text).read_text())["input_ids"][:tokens]
    f32 = perplexity(base, ids, rows)
    print(f"{model}: {len(ids)} tokens of {text}, {rows} rows a step; float32 perplexity {f32:.4f}")
    for linears, head in VARIANTS:
        skeleton, tok, tensors = load_quantized_folder(folder, "int8", "float32", check=native_unsupported,
                                                       head=head, linears=linears)
        p = perplexity(ModelRunner(skeleton, tok, tensors=tensors, n_cells=1024), ids, rows)
        print(f"linears {linears}, head {head or 'float32'}: {p:.4f} ({(p / f32 - 1) * 100:+.2f}%)", flush=True)


def _load_avg() -> str:
    return " ".join(f"{v:.2f}" for v in machine_info()["load_average"] or ())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.quantize", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a float folder or a known model name")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seqs", type=int, default=8, help="sequences decoded at once, besides 1")
    p.add_argument("--paths", default=",".join(PATHS), help=f"a subset of {','.join(PATHS)} (float32 is the base)")
    p.add_argument("--no-rss", action="store_true", help="skip the one-process-per-path memory measurement")
    p.add_argument("--rss-only", choices=list(PATHS), help=argparse.SUPPRESS)
    p.add_argument("--perplexity", metavar="TEXT", help="compare block formats' perplexity on this text file")
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--rows", type=int, default=8, help="prompt rows a step (--perplexity)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.perplexity:
        compare_formats(args.model, args.perplexity, args.tokens, args.rows)
        return 0
    if args.rss_only:
        rss_only(args.model, args.rss_only, args.max_tokens)
        return 0
    paths = [q for q in PATHS if q in args.paths.split(",")]
    if "float32" not in paths:
        p.error("--paths must include float32, the base of the ratios")
    print("command:", shlex.join([sys.executable, "-m", "engine.bench.quantize", *(argv or sys.argv[1:])]))
    print("machine:", machine(), "| load average", _load_avg(), flush=True)
    if not args.no_rss:
        _print_memory({q: _memory(args, q) for q in paths})
    runners = {q: load(args.model, q) for q in paths}
    vocab = runners["float32"].config.vocab_size
    loads = {"1 seq": prompts_for(1, 64, seed=1, vocab_size=vocab),
             f"{args.seqs} seq": prompts_for(args.seqs, 64, seed=2, vocab_size=vocab)}
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.repeats):
        for q in paths:  # alternating, so a noisy moment hits every path alike
            for name, prompts in loads.items():
                rate, _ = run(runners[q], prompts, args.max_tokens)
                best[(q, name)] = max(best.get((q, name), 0.0), rate)
    print(f"\nmodel {args.model}, {args.threads} threads; prompts of 64 tokens, {args.max_tokens} generated "
          f"(greedy, EOS ignored); best of {args.repeats}, paths alternating; x = against float32 in this run")
    print(f"{'path':9} " + " ".join(f"{name + ' tok/s':>14} {'x':>5}" for name in loads))
    for q in paths:
        print(f"{q:9} " + " ".join(f"{best[(q, n)]:14.1f} {best[(q, n)] / best[('float32', n)]:5.2f}"
                                   for n in loads))
    print("load average after:", _load_avg())
    return 0


def _print_memory(mem: dict) -> None:
    print(f"\n{'path':9} {'linears MB':>10} {'x':>6} {'weights MB':>10} {'x':>6} {'peak RSS MB':>11} {'x':>6}"
          f"   (one process per path, {N_CELLS} cells, after one 8-sequence round)", flush=True)
    base = mem["float32"]
    for q, m in mem.items():
        print(f"{q:9} " + " ".join(f"{m[k] / 1e6:{w}.1f} {m[k] / base[k]:6.3f}"
                                   for k, w in (("linears", 10), ("weights", 10), ("peak_rss", 11))), flush=True)


def _memory(args, path: str) -> dict:
    """One fresh process for `path`: its peak RSS is that path's alone."""
    cmd = [sys.executable, "-m", "engine.bench.quantize", "--model", args.model, "--rss-only", path,
           "--threads", str(args.threads), "--max-tokens", str(args.max_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(main())
