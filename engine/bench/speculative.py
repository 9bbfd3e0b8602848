"""Speculative decoding, on against off in one run: tok/s per workload and client count, acceptance, and
whether the outputs are identical.

    python -m engine.bench.speculative [--model smollm2-135m-instruct] [--clients 1,8] [--repeats 2]

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
from engine.loader.source import resolve_args
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
        ) -> tuple[float, list[list[int]]]:
    """Greedy completions of `prompts`; with `temperature`, regenerates instead (`REGENERATE`)."""
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
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", [] if on[i] else p, params[i], sink(f"r{i}"), on[i])
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t
    for seq_id in list(engine.persistent.by_id):  # the runner's pool outlives this engine: leave it empty
        engine.delete(seq_id)
    return wall, [outs[f"r{i}"] for i in range(len(prompts))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.speculative", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--clients", default="1,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mode", default="auto", choices=["auto", "ngram"], help="the speculative mode set against off")
    names = [*WORKLOADS, *REGENERATE]
    p.add_argument("--workloads", default=",".join(names), help="comma-separated, of " + ", ".join(names))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("command:", shlex.join([sys.executable, "-m", "engine.bench.speculative", *(argv or sys.argv[1:])]))
    print("machine:", machine())
    base, _ = resolve_args(EngineArgs(model=args.model, dtype=args.dtype))
    runner = ModelRunner.from_pretrained(base.model, dtype=base.dtype, **base.runner_kwargs())
    tok = runner.tokenizer
    mode = args.mode
    print(f"{'workload':8} {'clients':>7} {'off tok/s':>10} {mode + ' tok/s':>12} {'x':>6} {'accepted':>9} same")
    for name in args.workloads.split(","):
        text = WORKLOADS.get(name, WORKLOADS["free"])
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        for clients in (int(c) for c in args.clients.split(",")):
            best, outs, rate = {}, {}, 0.0
            for _ in range(args.repeats):
                for m in ("off", mode):
                    engine = Engine(runner, EngineArgs(speculative=m, prefix_caching=False))
                    wall, got = run(engine, [list(ids)] * clients, args.max_tokens, REGENERATE.get(name))
                    tokens = sum(len(o) for o in got)
                    best[m] = max(best.get(m, 0.0), tokens / wall)
                    outs[m] = got
                    if engine.speculative is not None and engine.speculative.drafted:
                        rate = engine.speculative.accepted / engine.speculative.drafted
            same = "yes" if outs["off"] == outs[mode] else "no"
            print(f"{name:8} {clients:7d} {best['off']:10.1f} {best[mode]:12.1f} "
                  f"{best[mode] / best['off']:6.2f} {rate:9.0%} {same}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
