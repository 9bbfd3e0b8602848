"""Speculative decoding, on against off in one run: tok/s per workload and client count, acceptance, and
whether the outputs are identical.

    python -m engine.bench.speculative [--model smollm2-135m-instruct] [--clients 1,8] [--repeats 2]
    python -m engine.bench.speculative --dtype float32 --draft-model smollm2-135m-instruct --draft-dtype quantized

Workloads where output repeats input (real weights are needed: random weights never accept a draft):
`edit` (return a short program with one change), `quote` (answer by quoting the passage), `free`
(an open question: little to copy, where speculation must not cost), and `regen` / `regen-sampled`: a
chat page's regenerate (each client's conversation is a persistent sequence that answered the open
question once, untimed; the timed reply is generated on a fork where that answer began, greedy or sampled
at temperature 0.8 with a seed of its own: drafts come from the parent's old answer). Every request is greedy and runs
to `--max-tokens` or EOS; the engine runs the same requests with `speculative=--mode` and `"off"`,
alternating `--repeats` times, and the best wall time of each is kept. In bf16 a drafted row runs through
the multi-row kernels, so on a near-tie its argmax can differ from the one-row step's (as batching can);
`same` compares the outputs, and float32 (`--dtype float32`) gives identical ones.

`--draft-model M` adds a third engine in the same alternation: `--mode` with that draft model (engine/core/
draft_model.py; `--draft-dtype`, "auto": a .gguf's own blocks), reported beside n-gram alone; `accepted` is
then the draft model's own drafts kept (n-gram drafts, tried first, are counted in the n-gram column).
"""

import argparse
import shlex
import sys
import time

import torch

from engine.api.args import EngineArgs
from engine.api.sampling_params import SamplingParams
from engine.bench.machine import machine
from engine.core.engine import Engine
from engine.loader.source import resolve_args, resolve_model
from engine.model.runner import ModelRunner

PROGRAM = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)


def describe(width, height):
    return f"{width} x {height}: area {area(width, height)}, perimeter {perimeter(width, height)}"
'''
PASSAGE = ("The cell cache holds one token's keys and values for every layer, that token's position and the "
           "set of sequences owning it. A cell is free when nobody owns it. Forks share cells, cancels drop "
           "claims, and a cell frees when its last owner leaves.")
WORKLOADS = {
    "edit": f"Rename the function `area` to `rect_area` everywhere in this code and return the whole code.\n\n"
            f"```python\n{PROGRAM}```",
    "quote": f"Repeat the following passage word for word.\n\n{PASSAGE}",
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
REGENERATE = {"regen": 0.0, "regen-sampled": 0.8}  # workload -> the regenerate's temperature (on `free`)


def run(engine: Engine, prompts: list[list[int]], max_tokens: int, temperature: float | None = None
        ) -> tuple[float, float, list[list[int]]]:
    """Greedy completions of `prompts`; with `temperature`, regenerates instead (`REGENERATE`). Returns
    (wall seconds, process CPU seconds, outputs): on a machine others load, CPU time is the steadier one."""
    outs: dict[str, list[int]] = {}

    def sink(rid):
        return lambda out: outs.setdefault(rid, []).extend(out.outputs[0].token_ids)

    on = [None] * len(prompts)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0)] * len(prompts)
    if temperature is not None:  # the first answers, untimed; then the regenerates, on forks
        seqs = [engine.create_sequence(p)[0] for p in prompts]
        while engine.has_unfinished():  # their prefills
            engine.step()
        for i, seq in enumerate(seqs):
            engine.add_request(f"first{i}", [], SamplingParams(max_tokens=max_tokens, temperature=0), None,
                               seq.seq_id)
        while engine.has_unfinished():
            engine.step()
        on = [engine.fork(seq.seq_id, len(p)).seq_id for seq, p in zip(seqs, prompts)]
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i) for i in range(len(prompts))]
    t, cpu = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", [] if on[i] else p, params[i], sink(f"r{i}"), on[i])
    while engine.has_unfinished():
        engine.step()
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    for seq_id in list(engine.persistent.by_id):  # the runner's pool outlives this engine: leave it empty
        engine.delete(seq_id)
    return wall, cpu, [outs[f"r{i}"] for i in range(len(prompts))]


def measure(runner: ModelRunner, draft: ModelRunner | None, modes: list[str], prompts: list[list[int]],
            max_tokens: int, temperature: float | None, repeats: int) -> dict[str, tuple[float, float, list, float]]:
    """mode -> (best tok/s, best tokens per CPU second, outputs, acceptance), the modes alternating `repeats`
    times; "draft" is `modes[1]` (the speculative mode) with the draft model."""
    best: dict[str, float] = {}
    per_cpu: dict[str, float] = {}
    outs: dict[str, list] = {}
    rate: dict[str, float] = {}
    for _ in range(repeats):
        for m in modes:
            spec = modes[1] if m == "draft" else m
            engine = Engine(runner, EngineArgs(speculative=spec, prefix_caching=False), draft if m == "draft" else None)
            wall, cpu, got = run(engine, prompts, max_tokens, temperature)
            tokens = sum(len(o) for o in got)
            best[m] = max(best.get(m, 0.0), tokens / wall)
            per_cpu[m] = max(per_cpu.get(m, 0.0), tokens / cpu)
            outs[m] = got
            counter = engine.speculative.drafter if m == "draft" else engine.speculative
            if counter is not None and counter.drafted:
                rate[m] = counter.accepted / counter.drafted
    return {m: (best[m], per_cpu[m], outs[m], rate.get(m, 0.0)) for m in modes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.speculative", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--clients", default="1,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mode", default="auto", choices=["auto", "ngram"], help="the speculative mode set against off")
    p.add_argument("--draft-model", default=None, help="also measure --mode with this draft model")
    p.add_argument("--draft-dtype", default="auto")
    names = [*WORKLOADS, *REGENERATE]
    p.add_argument("--workloads", default=",".join(names), help="comma-separated, of " + ", ".join(names))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("command:", shlex.join([sys.executable, "-m", "engine.bench.speculative", *(argv or sys.argv[1:])]))
    print("machine:", machine())
    base, _ = resolve_args(EngineArgs(model=args.model, dtype=args.dtype))
    runner = ModelRunner.from_pretrained(base.model, dtype=base.dtype, **base.runner_kwargs())
    draft = None
    if args.draft_model:
        draft_dir = resolve_model(args.draft_model, args.draft_dtype).path
        draft = ModelRunner.from_pretrained(draft_dir, dtype=args.draft_dtype, **{**base.runner_kwargs(),
                                                                                  "n_cells": runner.n_cells})
    tok = runner.tokenizer
    mode = args.mode
    modes = ["off", mode, *(["draft"] if draft is not None else [])]
    print("x: tok/s against off's; cpu x: tokens per CPU second against off's (steadier on a loaded machine)")
    head = f"{'workload':8} {'clients':>7} {'off tok/s':>10} " + " ".join(
        f"{m + ' tok/s':>12} {'x':>6} {'cpu x':>6} {'accepted':>9} same" for m in modes[1:])
    print(head)
    for name in args.workloads.split(","):
        text = WORKLOADS.get(name, WORKLOADS["free"])
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        for clients in (int(c) for c in args.clients.split(",")):
            got = measure(runner, draft, modes, [list(ids)] * clients, args.max_tokens, REGENERATE.get(name),
                          args.repeats)
            off = got["off"]
            cols = [f"{t:12.1f} {t / off[0]:6.2f} {c / off[1]:6.2f} {r:9.0%} {'yes' if o == off[2] else 'no'}"
                    for t, c, o, r in (got[m] for m in modes[1:])]
            print(f"{name:8} {clients:7d} {off[0]:10.1f} " + " ".join(cols), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
