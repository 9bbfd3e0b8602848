"""Engine-core benchmark: decode throughput over cells, and the cost of the cell bookkeeping.

Run: `python -m engine.bench.attention [--threads 2] [--concurrency 1,8,32] [--steps 32]
[--paths fast,reference] [--json out.json]`.

Model: a 56M-parameter Llama (hidden 512, intermediate 1408, 8 layers, 8 heads, 4 KV heads, vocab
32000, untied), random weights from `torch.manual_seed(0)`, fp32, sdpa. For each attention path and
each concurrency B it prefills B prompts of `--prompt-len` tokens in one flat step, then runs
`--steps` greedy decode steps of all B sequences, one flat step each. It reports:
- decode tokens/s and ms per step, in wall time and in process CPU time (the box is shared, so CPU
  time is the steadier figure; it counts every torch thread, so it can exceed wall time);
- the bookkeeping per step: wall time spent inside `CellCache.begin_step` and `build_mask`, timed
  directly around those calls while the real `ModelRunner.forward` runs, and its share of the step;
- HF `model.generate` on 1 sequence (decode only, timed from its first to its last new token), and
  the ratio cells/HF at B=1; greedy tokens are checked to be the same.

With every cell visible to some query of the step (the default, `--idle 0`), both paths read the
same window and should time alike; `--idle N` parks an idle sequence on the N lowest cells, which the
reference path reads every step and the fast path skips. `--repeats N` reports the fastest of N runs.

This is a measurement, not a test: nothing here asserts timings.
"""

import argparse
import functools
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

import engine.model.runner as runner_mod
from engine.api.args import EngineArgs
from engine.bench.common import Clock, bench_llama_56m, prompts_for, run_hf_generate
from engine.bench.machine import machine_info
from engine.model.runner import ModelRunner


@dataclass
class DecodeRow:
    """One attention path at one concurrency (`bench engine`'s `Row` is a whole run's throughput)."""

    path: str
    concurrency: int
    prefill_tok_s: float
    decode_tok_s: float  # wall
    decode_tok_s_cpu: float  # tokens per second of process CPU time
    step_ms: float  # median wall ms per decode step
    step_ms_cpu: float  # median process-CPU ms per decode step
    bookkeeping_ms: float  # median wall ms per decode step inside begin_step + build_mask
    bookkeeping_frac: float  # bookkeeping / step, from the medians
    read_len: int  # read window at the last decode step
    vs_hf: float | None = None  # decode tok/s over HF generate's, at B=1
    same_tokens_as_hf: bool | None = None


class Bookkeeping:
    """Times `begin_step` and `build_mask` inside a runner's real forward, by wrapping them in place."""

    def __init__(self, runner: ModelRunner):
        self.seconds = 0.0
        self._begin = runner.cache.begin_step
        self._mask = runner_mod.build_mask
        runner.cache.begin_step = self._timed(self._begin)
        runner_mod.build_mask = self._timed(self._mask)
        self._runner = runner

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return wrapper

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def close(self) -> None:
        del self._runner.cache.begin_step  # drop the instance attribute: the class method shows again
        runner_mod.build_mask = self._mask


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return prompts_for(batch, length, seed=1234, vocab_size=vocab)


def run_cells(model, path: str, batch: int, prompt_len: int, steps: int, threads: int, idle: int = 0):
    """Prefill `batch` prompts in one step, then `steps` decode steps of all of them; return (row, tokens of seq 0).

    With `idle > 0`, an idle sequence first takes the `idle` lowest cells: the reference path reads them
    every step, the fast path skips them.
    """
    args = EngineArgs(n_cells=idle + batch * (prompt_len + steps + 1), max_num_seqs=batch + 1, threads=threads,
                      attention=path)  # batch + 1 sequences: the idle one takes slot `batch`
    runner = ModelRunner(model, **args.runner_kwargs())
    seqs = prompts(batch, prompt_len, model.config.vocab_size)
    for start in range(0, idle, 256):
        chunk = prompts(1, min(256, idle - start), model.config.vocab_size)[0]
        runner.run({batch: (chunk, start)})
    # warm-up (allocates the pools, first-call overheads), then an empty pool again
    runner.run({s: (p[:4], 0) for s, p in enumerate(seqs)})
    for s in range(batch):
        runner.cache.seq_rm(s)
    assert runner.cache.used_cells() == idle, "the warm-up must leave only the idle sequence's cells"
    clock = Clock()
    last = runner.run({s: (p, 0) for s, p in enumerate(seqs)})
    prefill_wall, _ = clock.lap()
    generated = {s: [] for s in range(batch)}
    walls, cpus, books = [], [], []
    book = Bookkeeping(runner)
    try:
        for step in range(steps):
            for s in range(batch):
                generated[s].append(int(last[s].argmax()))
            clock.lap()
            book.take()
            last = runner.run({s: ([generated[s][-1]], prompt_len + step) for s in range(batch)})
            wall, cpu = clock.lap()
            walls.append(wall)
            cpus.append(cpu)
            books.append(book.take())
    finally:
        book.close()
    step_ms, step_ms_cpu, book_ms = (statistics.median(x) * 1e3 for x in (walls, cpus, books))
    row = DecodeRow(path, batch, batch * prompt_len / prefill_wall, batch * steps / sum(walls),
              batch * steps / max(sum(cpus), 1e-9), step_ms, step_ms_cpu, book_ms, book_ms / step_ms,
              runner.cache.read_len)
    return row, generated[0]


class _Stamps:
    """A `generate` streamer that records the time of every new token (the first `put` is the prompt)."""

    def __init__(self):
        self.times: list[tuple[float, float]] = []
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append((time.perf_counter(), time.process_time()))
        self.tokens.extend(value.reshape(-1).tolist())

    def end(self):
        pass


def best_of(repeats: int, fn, key):
    """The run with the highest `key` among `repeats` runs: the least disturbed one on a shared machine."""
    return max((fn() for _ in range(repeats)), key=key)


def run_hf_decode(model, prompt_len: int, steps: int):
    """HF generate on one sequence: decode tok/s (wall, cpu) from its first to last new token, and its tokens."""
    prompt = prompts(1, prompt_len, model.config.vocab_size)
    run_hf_generate(model, prompt, 4)  # warm-up
    stamps = _Stamps()
    run_hf_generate(model, prompt, steps + 1, streamer=stamps)
    (w0, c0), (w1, c1) = stamps.times[0], stamps.times[-1]
    return steps / (w1 - w0), steps / max(c1 - c0, 1e-9), stamps.tokens


def format_table(rows: list[DecodeRow], hf: tuple[float, float]) -> str:
    head = (f"{'path':<10} {'B':>3} {'prefill tok/s':>13} {'decode tok/s':>12} {'tok/cpu-s':>10} "
            f"{'ms/step':>8} {'cpu ms/step':>11} {'bookkeep ms':>11} {'bookkeep %':>10} {'read_len':>8} "
            f"{'vs HF':>6} {'=HF toks':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        vs = f"{r.vs_hf:.2f}" if r.vs_hf is not None else ""
        same = {None: "", True: "yes", False: "NO"}[r.same_tokens_as_hf]
        lines.append(f"{r.path:<10} {r.concurrency:>3} {r.prefill_tok_s:>13.1f} {r.decode_tok_s:>12.1f} "
                     f"{r.decode_tok_s_cpu:>10.1f} {r.step_ms:>8.2f} {r.step_ms_cpu:>11.2f} "
                     f"{r.bookkeeping_ms:>11.3f} {100 * r.bookkeeping_frac:>9.2f}% {r.read_len:>8} {vs:>6} {same:>8}")
    lines.append(f"{'hf-generate':<10}   1 {'':>13} {hf[0]:>12.1f} {hf[1]:>10.1f}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.bench.attention", description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated numbers of sequences")
    p.add_argument("--steps", type=int, default=32, help="greedy decode steps per run")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    p.add_argument("--paths", default="fast,reference", help="attention paths to measure")
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration; the fastest is reported")
    p.add_argument("--idle", type=int, default=0,
                   help="cells held by an idle sequence below the active ones (the fast path skips them)")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x]
    args.paths = [x for x in args.paths.split(",") if x]
    if args.steps < 2 or args.prompt_len < 4 or not args.concurrency or min(args.concurrency) < 1:
        p.error("need --steps >= 2, --prompt-len >= 4 and concurrencies >= 1")
    if args.repeats < 1 or args.idle < 0:
        p.error("need --repeats >= 1 and --idle >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    torch.set_num_threads(args.threads)
    info = machine_info()
    print("command:", shlex.join([sys.executable, "-m", "engine.bench.attention", *(argv or sys.argv[1:])]))
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    model = bench_llama_56m().to(torch.float32)
    model.set_attn_implementation("sdpa")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama {n_params / 1e6:.1f}M params, fp32, sdpa; prompt {args.prompt_len} tokens, "
          f"{args.steps} decode steps, {args.idle} idle cells, best of {args.repeats}", flush=True)
    hf = best_of(args.repeats, lambda: run_hf_decode(model, args.prompt_len, args.steps), key=lambda r: r[0])
    rows = []
    for path in args.paths:
        for batch in args.concurrency:
            row, tokens = best_of(
                args.repeats,
                functools.partial(run_cells, model, path, batch, args.prompt_len, args.steps, args.threads, args.idle),
                key=lambda r: r[0].decode_tok_s,
            )
            if batch == 1:
                row.vs_hf = row.decode_tok_s / hf[0]
                row.same_tokens_as_hf = tokens == hf[2][: len(tokens)]
            rows.append(row)
            print(f"  done {path} B={batch}: {row.decode_tok_s:.1f} tok/s", flush=True)
    print(format_table(rows, hf))
    print("bookkeep = wall time inside CellCache.begin_step + build_mask per decode step (median); "
          "cpu = process time, all threads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "machine": info, "params": n_params,
                       "hf_generate": {"decode_tok_s": hf[0], "decode_tok_s_cpu": hf[1]},
                       "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
