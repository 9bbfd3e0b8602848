"""Durable sequences (`--state-dir`, #28): a fork family back after a restart, restored vs recomputed.

    python -m engine.bench.durable [--model smollm2-135m-instruct] [--dtype float32] [--prefix-len 2000]
                                   [--branches 8] [--branch-len 32] [--many 1000]

A root sequence over `--prefix-len` random tokens, `--branches` forks of it, each continued with its own
`--branch-len` tokens (prefilled, max_tokens 0), all written to a state dir. Then, each on a fresh engine
over the same model and its own copy of that folder: restore time, then the time to first token of each
branch continued by one token, one branch after the other, restored (1) *lazily* (the default: cells load
from disk when a branch is scheduled), (2) *eagerly* (`state_eager`: loaded at start), (3) *recomputed*: the
same records without their cell files (tokens only; the first branch re-prefills the prefix, later ones share
it through the prefix cache). Then bytes: the cell files on disk vs `--branches` times one branch's own size
(what saving each sequence's KV separately would take, llama.cpp's slot save). Last, the restore time of
`--many` sequences (forks of the root at chunk boundaries: records read; eagerly: cells shared too).
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from engine.api.args import EngineArgs
from engine.api.sampling_params import SamplingParams
from engine.bench.common import prompts_for
from engine.bench.machine import machine
from engine.core.engine import Engine
from engine.core.state.cell_files import CHUNK
from engine.loader.hf import load_hf_folder
from engine.loader.source import resolve_args
from engine.model.runner import ModelRunner


def engine_on(model, tokenizer, args: EngineArgs) -> Engine:
    """A fresh engine (fresh cell pool) over the already loaded model."""
    return Engine(ModelRunner(model, tokenizer, **args.runner_kwargs()), args)


def drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def build_family(engine: Engine, prefix: list[int], tails: list[list[int]]) -> list[str]:
    root, _ = engine.create_sequence(prefix)
    drain(engine)
    branches = []
    for i, tail in enumerate(tails):
        seq_id = engine.fork(root.seq_id).seq_id
        engine.add_request(f"tail-{i}", tail, SamplingParams(max_tokens=0), seq_id=seq_id)
        drain(engine)
        branches.append(seq_id)
    return branches


def next_token(engine: Engine, seq_id: str) -> tuple[float, float]:
    """Seconds to the first token of a one-token continuation of the sequence, and seconds until its request
    is done (the sequence and its new cells written to the state dir too)."""
    seen: list[float] = []
    t0 = time.perf_counter()
    engine.add_request(f"next-{seq_id}", [42], SamplingParams(max_tokens=1, temperature=0),
                       lambda out, seen=seen: seen.append(time.perf_counter()), seq_id=seq_id)
    drain(engine)
    return seen[0] - t0, time.perf_counter() - t0


def timed_page_ins(engine: Engine) -> list[float]:
    """Seconds each admission that loaded cells from disk (`Scheduler.page_in`) took (instruments it)."""
    took, page_in = [], engine.scheduler.page_in
    if engine.scheduler.store is not None:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            gained = page_in(*args, **kwargs)
            if gained:
                took.append(time.perf_counter() - t0)
            return gained
        engine.scheduler.page_in = timed
    return took


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.durable", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a folder, .gguf or known name; 'bundled'")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prefix-len", type=int, default=2000)
    p.add_argument("--branches", type=int, default=8)
    p.add_argument("--branch-len", type=int, default=32)
    p.add_argument("--many", type=int, default=1000)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    base = EngineArgs(model=None if a.model == "bundled" else a.model, dtype=a.dtype, threads=a.threads,
                      n_cells=a.prefix_len + a.branches * (a.branch_len + 8) + 512, max_num_batched_tokens=2048,
                      max_num_seqs=max(256, a.many // 2 + 8), speculative="off")
    base, name = resolve_args(base)
    # the model stays this benchmark's (engine_on builds more runners over it): loaded here, not by a runner,
    # which would release the modules' weights (engine/model/module_weights.py)
    model, tok = load_hf_folder(base.model, dtype=base.dtype)
    runner = ModelRunner(model, tok, **base.runner_kwargs())
    vocab = runner.config.get_text_config().vocab_size
    prefix = prompts_for(1, a.prefix_len, seed=1, vocab_size=vocab)[0]
    tails = prompts_for(a.branches, a.branch_len, seed=2, vocab_size=vocab)
    work = Path(tempfile.mkdtemp(prefix="cellserve-durable-"))
    try:
        state = work / "state"
        first = Engine(runner, EngineArgs(**{**base.__dict__, "state_dir": state}))
        t0 = time.perf_counter()
        branches = build_family(first, prefix, tails)
        built_s = time.perf_counter() - t0
        cell_bytes = runner.cell_bytes
        del first

        # Three engines side by side, each on its own copy of the folder, and the branches continued in turn on
        # each (branch 1 on lazy, eager, recomputed, then branch 2...): a busy machine's drift hits all alike.
        shutil.copytree(state / "sequences", work / "recomputed" / "sequences")  # tokens only
        engines, runs, paging = {}, {}, {}
        for variant, eager in (("lazy", False), ("eager", True), ("recomputed", False)):
            if variant != "recomputed":
                shutil.copytree(state, work / variant)
            t0 = time.perf_counter()
            engines[variant] = engine_on(model, tok, EngineArgs(**{**base.__dict__, "state_dir": work / variant,
                                                                   "state_eager": eager}))
            runs[variant] = (time.perf_counter() - t0, [], [])
            engines[variant].add_request("warm-up", [5], SamplingParams(max_tokens=1))  # a first forward's costs
            drain(engines[variant])
            paging[variant] = timed_page_ins(engines[variant])
        for seq_id in branches:
            for variant, engine in engines.items():
                first_s, done_s = next_token(engine, seq_id)
                runs[variant][1].append(first_s)
                runs[variant][2].append(done_s)
        del engines

        on_disk = dir_bytes(state / "cells")
        per_seq = (a.prefix_len + a.branch_len - 1) * cell_bytes  # one branch's cells, saved on its own

        many = work / "many"
        maker = engine_on(model, tok, EngineArgs(**{**base.__dict__, "state_dir": many}))
        chunks = max(1, min(8, (a.prefix_len - 1) // CHUNK))
        root, _ = maker.create_sequence(prefix[: chunks * CHUNK + 1])
        drain(maker)
        for i in range(a.many - 1):
            maker.fork(root.seq_id, CHUNK * (1 + i % chunks) + 1)
        del maker
        t_many = {}
        for eager in (False, True):
            t0 = time.perf_counter()
            engine_on(model, tok, EngineArgs(**{**base.__dict__, "state_dir": many, "state_eager": eager}))
            t_many[eager] = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine_on(model, tok, base)
        t_empty = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"# python -m engine.bench.durable {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"# {machine()}")
    print(f"model {name} ({base.dtype}), {cell_bytes} B/cell; family: {a.prefix_len}-token prefix, {a.branches} "
          f"branches of {a.branch_len} tokens (built and saved in {built_s:.1f} s)")
    print("restore of the family (engine build included), then TTFT of a one-token continuation of each branch:")
    rec = runs["recomputed"][1]
    for variant, (load_s, first_s, done_s) in runs.items():
        print(f"  {variant:10s}: restore {load_s:6.2f} s; TTFT first {first_s[0] * 1e3:8.1f} ms, mean "
              f"{statistics.mean(first_s) * 1e3:8.1f} ms (with the write: mean {statistics.mean(done_s) * 1e3:8.1f} ms)"
              + ("" if variant == "recomputed" else f"; vs recomputed: first {rec[0] / first_s[0]:.1f}x, all "
                 f"{sum(rec) / sum(first_s):.1f}x"))
        if variant == "lazy":
            print(f"  {'':10s}  of which loading cells from disk at admission: first {paging[variant][0] * 1e3:.1f} "
                  f"ms, all {a.branches} {sum(paging[variant]) * 1e3:.1f} ms")
    print(f"cell files on disk: {on_disk / 2**20:.1f} MiB vs {a.branches} x one branch = "
          f"{a.branches * per_seq / 2**20:.1f} MiB ({on_disk / (a.branches * per_seq):.2f}x)")
    for eager, took in t_many.items():
        print(f"restore of {a.many} sequences (forks at chunk boundaries), {'eager' if eager else 'lazy'}: "
              f"{took - t_empty:.2f} s ({(took - t_empty) / a.many * 1e3:.2f} ms each; engine build {t_empty:.2f} s "
              "left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
