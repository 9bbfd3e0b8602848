"""`cellserve bench engine`: offline engine throughput, side by side with transformers in one run.

For each concurrency level C, C requests (random `--prompt-len` token prompts, `--output-len`
greedy tokens, EOS ignored) are submitted at once and run to completion by:
- cellserve's Engine (continuous batching over the cell pool);
- transformers' own continuous batching (`model.generate_batch`), if `--hf-cb`;
- sequential `model.generate`, one request after another (measured on a few requests, as tokens/s).
It prints the command, the machine and generated tokens/s with ratios against the baselines, and
the share of each step spent outside the model forward (scheduling, planning, sampling, detok).

What the engine-side benchmarks share (the 56M model, its prompts, `Row`, `Clock`, the `generate`
baseline) lives in engine/bench/common.py, the machine description in engine/bench/machine.py. It never
imports server/: the words of `--save-model`'s tokenizer (the load generator's) are handed to `main` by
`cellserve bench engine` (server/cli.py).
"""

import argparse
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, replace

import torch

from engine.api.args import EngineArgs
from engine.api.sampling_params import SamplingParams
from engine.bench.common import Clock, Row, bench_llama_56m, prompts_for, run_hf_generate, save_bench_model
from engine.bench.machine import machine
from engine.core.engine import Engine
from engine.model.runner import ModelRunner

NATIVE = {"auto": None, "off": False}


class TimedRunner(ModelRunner):
    """Counts time inside the model forward so the engine's own share of a step can be reported. It times
    `forward_hidden`, the one forward the engine calls (`forward` goes through it too)."""

    forward_s = 0.0

    def forward_hidden(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return super().forward_hidden(*args, **kwargs)
        finally:
            self.forward_s += time.perf_counter() - t


def run_cellserve(model, prompts, output_len: int, attention: str, concurrency: int | None = None,
                  native: bool | None = None, prefill_cap: int | None = None, range_ratio: float = 0.0) -> Row:
    """Run every prompt; with `concurrency` < len(prompts) keep that many in flight (closed loop, like
    `cellserve bench serve --concurrency`), else submit them all at once. With `range_ratio` r, each
    request's output length is drawn from [L(1-r), L(1+r)] (seeded), so requests end and new prompts
    arrive while others decode, as in a real load; `prefill_cap` sets the scheduler's prefill tokens
    per tick while sequences decode."""
    concurrency = concurrency or len(prompts)
    # a pool that holds every request in flight, full batches, no queue limit; the rest: EngineArgs' defaults
    args = EngineArgs(n_cells=concurrency * (max(len(p) for p in prompts) + output_len) + 64, attention=attention,
                      max_num_batched_tokens=2048, max_queue=1 << 20)
    if prefill_cap is not None:
        args = replace(args, prefill_while_decoding=prefill_cap)
    runner = TimedRunner(model, **args.runner_kwargs(), native=native)
    engine = Engine.from_args(args, runner)
    g = torch.Generator().manual_seed(2)
    lengths = (output_len * (1 - range_ratio + 2 * range_ratio * torch.rand(len(prompts), generator=g))).round()
    params = [SamplingParams(max_tokens=max(1, int(n)), temperature=0.0, ignore_eos=True) for n in lengths]
    sent: dict[str, float] = {}
    ttft: list[float] = []
    pending = list(enumerate(prompts))
    clock = Clock()

    def submit(k: int) -> None:
        for _ in range(k):
            if pending:
                i, p = pending.pop(0)
                sent[str(i)] = time.perf_counter()
                engine.add_request(str(i), p, params[i])

    submit(concurrency)
    step_s = 0.0
    gaps, cpu_gaps = [], []
    while engine.has_unfinished():
        decoding = any(s.num_generated > 0 for s in engine.scheduler.running)
        step = Clock()
        outs = engine.step()
        wall, cpu = step.lap()
        step_s += wall
        if decoding:
            gaps.append(wall)
            cpu_gaps.append(cpu)
        now = time.perf_counter()
        for out in outs:
            if out.request_id in sent and out.outputs and out.outputs[0].token_ids:
                ttft.append(now - sent.pop(out.request_id))
        submit(sum(o.finished for o in outs))
    wall, cpu = clock.lap()
    q, gap, cpu_gap = torch.tensor(ttft), torch.tensor(gaps or [0.0]) * 1e3, torch.tensor(cpu_gaps or [0.0]) * 1e3
    name = f"cellserve ({attention}{', native' if runner.native is not None else ''}"
    name += f", cap {prefill_cap})" if prefill_cap is not None else ")"
    print(f"{name} at {concurrency}: memory {engine.memory().lines()}")
    return Row(name, concurrency, engine.generated_tokens, wall, cpu,
               float(q.quantile(0.5)), float(q.quantile(0.99)), 1 - runner.forward_s / step_s,
               float(gap.quantile(0.5)), float(gap.quantile(0.99)), float(cpu_gap.quantile(0.99)))


def run_hf_cb(model, prompts, output_len: int) -> Row:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.set_attn_implementation("sdpa")  # a ModelRunner over this model switched it to cell_gather
    with torch.inference_mode():
        model.generate_batch(prompts[:1], generation_config=config)  # warm-up, not timed
        clock = Clock()
        out = model.generate_batch(prompts, generation_config=config)
    n = sum(len(o.generated_tokens) for o in out.values())
    return Row("transformers generate_batch", len(prompts), n, *clock.lap())


def print_table(rows: list[Row], baseline: Row) -> None:
    print(f"{'system':44} {'conc':>5} {'tokens':>7} {'wall s':>8} {'tok/s':>8} {'tok/cpu-s':>9} {'x generate':>10} "
          f"{'ttft p50':>9} {'ttft p99':>9} {'outside fwd':>11} {'gap p50/p99 ms':>15} {'cpu gap p99':>11}")
    for r in rows:
        ttft = (f"{r.ttft_p50_s:9.2f} {r.ttft_p99_s:9.2f}" if r.ttft_p50_s is not None else f"{'':9} {'':9}")
        out = f"{r.outside_forward:11.1%}" if r.outside_forward is not None else f"{'':11}"
        gap = f"{r.gap_p50_ms:7.0f}/{r.gap_p99_ms:<7.0f} {r.gap_cpu_p99_ms:11.0f}" if r.gap_p50_ms is not None else ""
        print(f"{r.system:44} {r.concurrency:5d} {r.generated_tokens:7d} {r.wall_s:8.2f} {r.tok_s:8.1f} "
              f"{r.generated_tokens / r.cpu_s:9.1f} {r.tok_s / baseline.tok_s:10.2f} {ttft} {out} {gap}")


def main(argv: list[str] | None = None, words: Iterable[str] = ()) -> int:
    """`cellserve bench engine ARGS`; `words` go first in `--save-model`'s tokenizer."""
    ap = argparse.ArgumentParser(prog="cellserve bench engine", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="local HF folder (default: the 56M-parameter Llama config, random weights)")
    ap.add_argument("--concurrency", default="1,8,32,64", help="comma-separated request counts")
    ap.add_argument("--requests", type=int, default=0, help="requests per level; more than the concurrency "
                    "runs a closed loop (the same shape as `bench serve`); default: concurrency, all at once")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="model dtype (bfloat16 uses the CPU's AVX512-BF16/AMX kernels where present)")
    ap.add_argument("--attention", default="fast", help="fast, reference, or both as 'fast,reference'")
    ap.add_argument("--native", default="auto", help="the fast path's native Llama-family forward: auto, off, "
                    "or 'auto,off' to run both (engine/model/native/model.py)")
    ap.add_argument("--hf-cb", default="8,32", help="concurrencies at which to run transformers generate_batch "
                    "('' to skip; it is slow on CPU)")
    ap.add_argument("--prefill-cap", default="", help="comma-separated prefill tokens per tick while sequences "
                    "decode, to compare (default: the scheduler's)")
    ap.add_argument("--range-ratio", type=float, default=0.0, help="output lengths drawn from [L(1-r), L(1+r)]")
    ap.add_argument("--generate-requests", type=int, default=2, help="requests for the sequential baseline")
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--save-model", metavar="DIR", help="only save the 56M model (with a tokenizer) to DIR, "
                    "for `cellserve serve --model DIR`, and exit")
    args = ap.parse_args(argv)
    if args.save_model:
        print("saved", save_bench_model(args.save_model, args.dtype, words))
        return 0
    torch.set_num_threads(args.threads)
    print("command:", "cellserve bench engine", " ".join(argv if argv is not None else sys.argv[1:]))
    print("machine:", machine())
    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).eval()
    else:
        model = bench_llama_56m()
    model = model.to(getattr(torch, args.dtype))
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {args.dtype}")
    levels = [int(c) for c in args.concurrency.split(",")]
    hf_levels = {int(c) for c in args.hf_cb.split(",") if c}
    vocab = model.config.vocab_size
    baseline = run_hf_generate(model, prompts_for(args.generate_requests, args.prompt_len, vocab_size=vocab),
                               args.output_len)
    rows = [baseline]
    for c in levels:
        prompts = prompts_for(max(c, args.requests), args.prompt_len, vocab_size=vocab)
        caps = [int(x) for x in args.prefill_cap.split(",") if x] or [None]
        level = [run_cellserve(model, prompts, args.output_len, attention, c, native, cap, args.range_ratio)
                 for cap in caps
                 for attention in args.attention.split(",")
                 for native in ([None] if attention != "fast" else [NATIVE[n] for n in args.native.split(",")])]
        if c in hf_levels:
            level.append(run_hf_cb(model, prompts, args.output_len))
        print_table(level, baseline)
        rows += level
    print()
    print_table(rows, baseline)
    for c in levels:
        ours = [r for r in rows if r.concurrency == c and r.system.startswith("cellserve")]
        hf = [r for r in rows if r.concurrency == c and r.system.startswith("transformers generate_batch")]
        if ours and hf:
            print(f"concurrency {c}: cellserve / transformers generate_batch = {ours[0].tok_s / hf[0].tok_s:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "argv": argv, "rows": [asdict(r) | {"tok_s": r.tok_s} for r in rows]},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
