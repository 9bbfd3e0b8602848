"""The one-row decode step's quantized linears alone, in a Q4_K_M file's shapes and kinds: the row kernel's share
of a token, without a model file.

    python -m engine.bench.quant_step [--shape qwen3] [--threads 2] [--steps 20]

Random weights (engine/bench/quant_kernels.random_weight), every layer its own, as llama-quantize's Q4_K_M lays
a dense model out: Q|K and O, [gate; up] in Q4_K; V and down in Q6_K in the layers `use_more_bits` picks (the
first and last eighth, every third between), Q4_K elsewhere; the LM head Q6_K. One step: every layer's calls at
one row (Q|K and V as two calls, as `GroupLinear` runs them), then the head; prints the best and median step
and the bytes streamed a step. Compare kernel builds by running it from each tree under the same load.
"""

import argparse
import statistics
import time

import torch

from engine.bench.machine import machine
from engine.bench.quant_kernels import random_weight
from engine.loader.gguf_tensors import KIND_IDS
from engine.model.kernels import build as kernels

# hidden, layers, q heads x head dim, kv heads, intermediate, vocabulary (the random files' SmolLM2 tokenizer)
SHAPES = {"qwen3": (1024, 28, 16 * 128, 8 * 128, 3072, 49152)}


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose V and down Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def calls(shape: str) -> list:
    """(tensors, kind id, op, K) of one step's calls, in order."""
    h, layers, q, kv, inter, vocab = SHAPES[shape]
    out = []

    def add(kind: str, n: int, k: int, op: str = "none") -> None:
        w = random_weight(kind, n, k, seed=len(out))
        out.append((w.tensors(), KIND_IDS[kind], op, k))

    for i in range(layers):
        big = "q6_k" if more_bits(i, layers) else "q4_k"
        add("q4_k", q + kv, h)
        add(big, kv, h)
        add("q4_k", h, q)
        add("q4_k", 2 * inter, h, "swiglu")
        add(big, h, inter)
    add("q6_k", vocab, h)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.quant_step", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    assert kernels.load(), kernels.why_not()
    torch.set_num_threads(args.threads)
    step = calls(args.shape)
    nbytes = sum(t.numel() * t.element_size() for ts, *_ in step for t in ts)
    xs = {k: torch.randn(1, k) for k in {c[3] for c in step}}
    times = []
    for _ in range(args.steps + 2):
        t = time.perf_counter()
        for ts, kind, op, k in step:
            torch.ops.cellserve.quant_linear(xs[k], ts, kind, None, None, op)
        times.append(time.perf_counter() - t)
    times = times[2:]
    best, med = min(times), statistics.median(times)
    print(f"machine: {machine()} | load average {' '.join(f'{v:.2f}' for v in __import__('os').getloadavg())}")
    print(f"{args.shape}: {len(step)} calls, {nbytes / 1e6:.1f} MB a step; best {best * 1e3:.2f} ms "
          f"({nbytes / best / 1e9:.1f} GB/s), median {med * 1e3:.2f} ms, {args.threads} threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
