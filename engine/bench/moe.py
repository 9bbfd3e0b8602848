"""A mixture-of-experts GGUF file's decode step with its experts in one `quant_moe` call a layer, against the
per-expert loop it replaced, in one process on the same load.

    python -m engine.bench.moe --gguf qwen3moe-q4_k_m.gguf [--sequences 1,8] [--threads 1] [--rounds 4] [--steps 4]

Per sequence count: a `ModelRunner` over the file, 64-token prompts, then decode steps alternating the two paths
(`moe.FUSED_ROWS` = 32: one call a layer for steps of up to 32 rows or `FUSED_PAIRS` pairs an expert; 0 and 0:
every step expert by expert), `--rounds` x `--steps` steps each; prints the best and median step. Both paths give the same tokens (bitwise the same
values: tests/engine/model/test_moe_kernel.py), so the sequences decode alike under either.
"""

import argparse
import time

import torch

from engine.bench.machine import machine
from engine.loader.source import resolve_model
from engine.model.native import moe
from engine.model.runner import ModelRunner

PATHS = {32: "one quant_moe call a layer", 0: "expert by expert"}


def run(runner: ModelRunner, n: int, rounds: int, steps: int, first: int = 0) -> dict[int, list[float]]:
    """Step times (seconds) of each path (`PATHS`) over `n` sequences decoding (ids from `first`)."""
    g = torch.Generator().manual_seed(0)
    vocab = runner.model.config.vocab_size
    hist = {first + s: torch.randint(vocab // 8, vocab, (64,), generator=g).tolist() for s in range(n)}
    out = runner.run({s: (h, 0) for s, h in hist.items()})
    times: dict[int, list[float]] = {f: [] for f in PATHS}

    def step() -> float:
        nonlocal out
        nxt = {s: int(out[s].argmax()) for s in hist}
        t = time.perf_counter()
        out = runner.run({s: ([nxt[s]], len(hist[s])) for s in hist})
        dt = time.perf_counter() - t
        for s, h in hist.items():
            h.append(nxt[s])
        return dt

    before = moe.FUSED_ROWS, moe.FUSED_PAIRS
    try:
        for _ in range(rounds):
            for f in PATHS:
                moe.FUSED_ROWS, moe.FUSED_PAIRS = (f, before[1]) if f else (0, 0)
                step()  # the first step after a switch: not timed
                times[f] += [step() for _ in range(steps)]
    finally:
        moe.FUSED_ROWS, moe.FUSED_PAIRS = before
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--sequences", default="1,8")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine())
    folder = resolve_model(args.gguf, "auto", progress=False).path
    runner = ModelRunner.from_pretrained(folder, n_cells=4096, threads=args.threads)
    first = 0
    for n in (int(v) for v in args.sequences.split(",")):
        for f, ts in run(runner, n, args.rounds, args.steps, first).items():
            ts = sorted(ts)
            print(f"{n} sequences, {args.threads} thread(s), {PATHS[f]}: best {ts[0] * 1e3:.1f} ms, "
                  f"median {ts[len(ts) // 2] * 1e3:.1f} ms a step")
        first += n


if __name__ == "__main__":
    main()
