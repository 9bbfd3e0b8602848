"""`cellserve bench serve`: command line of the load generator.

Entry points:
- `main(argv)`: parse the arguments that follow `bench serve` (a leading "serve" is tolerated),
  run, print the summary, return the exit status (0 ok, 1 nothing could be measured, 2 bad usage);
- `add_parser(subparsers)`: register `serve` on another argparse tree (dispatches via `func`);
- `main_with_subcommand(argv)`: for `python -m server.bench serve ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys

import httpx

from server.bench.client import RequestOptions, fetch_default_model
from server.bench.copying import COPY_KINDS, CopyWorkload
from server.bench.forktree import probe_sequences
from server.bench.jobs import Workload, make_job
from server.bench.metrics import Slo, Summary, parse_slo, summarize
from server.bench.multiturn import MultiTurnWorkload
from server.bench.regen import RegenWorkload, regen_rate
from server.bench.report import full_report, print_report, results_json, write_json
from server.bench.runner import Level, LevelResult, run_level
from server.bench.workloads import ForkTreeWorkload, RandomWorkload, SharedPrefixWorkload

DEFAULT_CONCURRENCY = 8
DEFAULT_NUM_REQUESTS = 100


class UsageError(ValueError):
    """A bad combination of arguments; reported with exit status 2."""


def _number_list(text: str, kind: type, name: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{name} expects a comma-separated list of numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise UsageError(f"{name} values must be > 0, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    """All `bench serve` flags (see docs/performance.md, 'Benchmarks: the tools')."""
    g = p.add_argument_group("target")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    g.add_argument("--model", help="model name to send (default: first entry of GET /v1/models)")
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions or /v1/chat/completions (fork-tree always uses /v1/sequences, "
                   "multi-turn always chat)")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", help="closed-loop users, or a sweep '1,8,32'; with --request-rate: "
                   f"a cap on requests in flight (default {DEFAULT_CONCURRENCY} without --request-rate)")
    g.add_argument("--request-rate", help="open loop: mean arrivals per second, 'inf' = all at once; "
                   "a list '1,2,4' sweeps")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    g.add_argument("--num-requests", type=int, help=f"requests (fork-tree: trees; multi-turn: conversations) per level "
                   f"(default {DEFAULT_NUM_REQUESTS} unless --duration is given)")
    g.add_argument("--duration", type=float, help="stop issuing new requests after this many seconds")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=["random", "shared-prefix", "fork-tree", "multi-turn", *COPY_KINDS, "regen"],
                   default="random", help="multi-turn: conversations resending their history through "
                   "/v1/chat/completions; edit / quote / summarise: answers that repeat the prompt (chat "
                   "endpoint); regen: a sequence answers, then a fork at the answer's start regenerates it")
    g.add_argument("--input-len", type=int, default=256, help="prompt words (about one token each)")
    g.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary uniformly by +-this fraction")
    g.add_argument("--num-groups", type=int, default=4, help="shared-prefix: number of shared system prompts")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: words per system prompt")
    g.add_argument("--turns", type=int, default=6, help="multi-turn: turns per conversation")
    g.add_argument("--system-len", type=int, default=0, help="multi-turn: words of each conversation's system prompt")
    g.add_argument("--branches", type=int, default=4, help="fork-tree: forks per trunk")
    g.add_argument("--branch-len", type=int, default=16, help="fork-tree: words appended to each branch")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (fixed output lengths)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", help="JSON object merged into every request body")
    g.add_argument("--lora-ids", type=int, default=0, help="N LoRA adapters loaded: request i names adapter id "
                   "i %% N with llama.cpp's per-request `lora: [{id, scale}]` (llama-server and cellserve)")
    g = p.add_argument_group("output")
    g.add_argument("--slo", help="goodput objectives in ms, e.g. 'ttft=500,tpot=50,e2el=5000'")
    g.add_argument("--out", help="write every record and the summary to this JSON file")
    g.add_argument("--plot", help="write PNG charts into this folder")
    g.add_argument("--no-progress", action="store_true", help="no live progress bar")


DESCRIPTION = "Load-test an OpenAI-compatible server; see docs/performance.md, 'Benchmarks: the tools'."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cellserve bench serve", description=DESCRIPTION)
    add_arguments(p)
    return p


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `serve` on an argparse subparsers object; its `func(args)` runs the benchmark."""
    p = subparsers.add_parser("serve", help="load-test an OpenAI-compatible server", description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run_args)
    return p


def build_levels(args: argparse.Namespace) -> list[Level]:
    """The load levels to run in turn (rates x concurrencies), validated."""
    rates = [None] if args.request_rate is None else _number_list(args.request_rate, float, "--request-rate")
    concs = [None] if args.concurrency is None else _number_list(args.concurrency, int, "--concurrency")
    if rates == [None] and concs == [None]:
        concs = [DEFAULT_CONCURRENCY]
    if len(rates) > 1 and len(concs) > 1:
        raise UsageError("sweep either --request-rate or --concurrency, not both at once")
    n = args.num_requests
    if n is None and args.duration is None:
        n = DEFAULT_NUM_REQUESTS
    if n is not None and n < 1:
        raise UsageError(f"--num-requests must be >= 1, got {n}")
    if args.duration is not None and not args.duration > 0:
        raise UsageError(f"--duration must be > 0 seconds, got {args.duration}")
    if n is None and any(r is not None and math.isinf(r) for r in rates):
        raise UsageError("--request-rate inf sends everything at once: give --num-requests too")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise UsageError(f"--burstiness must be a finite number > 0, got {args.burstiness}")
    return [Level(concurrency=c, request_rate=r, burstiness=args.burstiness, num_requests=n,
                  duration=args.duration, seed=args.seed) for r in rates for c in concs]


def build_workload(args: argparse.Namespace) -> Workload:
    common = {"input_len": args.input_len, "output_len": args.output_len,
              "range_ratio": args.range_ratio, "seed": args.seed}
    try:
        if args.workload == "shared-prefix":
            return SharedPrefixWorkload(num_groups=args.num_groups, prefix_len=args.prefix_len, **common)
        if args.workload == "fork-tree":
            return ForkTreeWorkload(branches=args.branches, branch_len=args.branch_len, **common)
        if args.workload == "multi-turn":
            return MultiTurnWorkload(turns=args.turns, system_len=args.system_len, **common)
        if args.workload == "regen":
            return RegenWorkload(**common)
        if args.workload in COPY_KINDS:
            if args.endpoint != "chat":
                raise ValueError(f"--workload {args.workload} asks a chat model to copy: add --endpoint chat")
            return CopyWorkload(kind=args.workload, **common)
        return RandomWorkload(**common)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _extra_body(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--extra-body is not valid JSON ({exc}); write e.g. '{{\"top_k\": 1}}'") from None
    if not isinstance(value, dict):
        raise UsageError("--extra-body must be a JSON object, e.g. '{\"top_k\": 1}'")
    return value


def workload_text(args: argparse.Namespace) -> str:
    text = f"{args.workload}: input~{args.input_len} words, max_tokens {args.output_len}"
    if args.range_ratio:
        text += f" (lengths +-{args.range_ratio:.0%})"
    if args.workload == "shared-prefix":
        text += f", {args.num_groups} groups x {args.prefix_len}-word prefix"
    if args.workload == "fork-tree":
        text += f", {args.branches} branches of ~{args.branch_len} words"
    if args.workload == "multi-turn":
        text += f", {args.turns} turns per conversation (history resent), system prompt {args.system_len} words"
    return text + f", ignore_eos={args.ignore_eos}, temperature={args.temperature:g}, seed={args.seed}"


async def _resolve_model(args: argparse.Namespace, base: str) -> str:
    if args.model:
        return args.model
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        return await fetch_default_model(client, base, headers)


async def _probe(args: argparse.Namespace, base: str, opts: RequestOptions) -> str | None:
    if args.workload not in ("fork-tree", "regen"):
        return None
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:
        return await probe_sequences(client, base, opts)


async def _run_levels(args, levels: list[Level], workload: Workload, base: str) -> tuple[str, list[LevelResult]]:
    model = await _resolve_model(args, base)
    opts = RequestOptions(model=model, endpoint=args.endpoint, temperature=args.temperature,
                          ignore_eos=args.ignore_eos, api_key=args.api_key,
                          extra_body=_extra_body(args.extra_body), lora_ids=args.lora_ids)
    skipped = await _probe(args, base, opts)
    if skipped:
        return model, [LevelResult(level=lv, skipped=skipped) for lv in levels]
    job, per_job = make_job(workload, opts, base)
    results = []
    for level in levels:
        results.append(await run_level(level, job, per_job=per_job, timeout=args.timeout,
                                       progress=not args.no_progress))
    return model, results


def run_args(args: argparse.Namespace, command: str | None = None) -> int:
    """Run a parsed `bench serve` command; returns the exit status."""
    try:
        levels = build_levels(args)
        workload = build_workload(args)
        slo: Slo | None = parse_slo(args.slo) if args.slo else None
        _extra_body(args.extra_body)
    except ValueError as exc:
        print(f"cellserve bench serve: error: {exc}", file=sys.stderr)
        return 2
    base = args.url.rstrip("/")
    try:
        model, results = asyncio.run(_run_levels(args, levels, workload, base))
    except RuntimeError as exc:
        print(f"cellserve bench serve: error: {exc}", file=sys.stderr)
        return 1
    summaries: list[Summary | None] = [
        None if r.skipped else summarize(r.records, r.duration_s, slo) for r in results
    ]
    # torch-free, and imported only here: importing the load generator imports nothing of engine/
    from engine.bench.machine import machine_info

    run = {
        "command": command or shlex.join(sys.argv),
        "machine": machine_info(),
        "config": {"url": base, "model": model, "endpoint": args.endpoint, "workload": args.workload,
                   "workload_text": workload_text(args), "slo": None if slo is None else vars(slo),
                   "args": {k: v for k, v in vars(args).items() if k != "func" and k != "api_key"}},
    }
    print_report(full_report(run, results, summaries))
    memory = server_memory(base, args.api_key)
    if memory:
        print(f"server memory after the run (cellserve:memory_bytes, MiB): {memory}")
    if args.workload == "regen":
        for r in results:
            rate = regen_rate(r.records)
            print(f"{r.level.label()}: regenerates {'-' if rate is None else f'{rate:.2f}'} tok/s (their tokens over "
                  "their latency)")
    if args.out:
        print(f"results: {write_json(args.out, results_json(run, results, summaries))}")
    if args.plot:
        from server.bench.plots import write_plots  # matplotlib is slow to import; only when asked

        print("plots: " + ", ".join(str(p) for p in write_plots(results, summaries, args.plot)))
    measured = [s for s in summaries if s is not None]
    if measured and not any(s.completed for s in measured):
        print("cellserve bench serve: error: every request failed; see the errors above", file=sys.stderr)
        return 1
    return 0


def server_memory(base: str, api_key: str | None) -> str:
    """A cellserve server's memory by owner from its /metrics ('' for any other server, or if unreachable)."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        text = httpx.get(base.rstrip("/") + "/metrics", headers=headers, timeout=10).text
        families = list(text_string_to_metric_families(text))
    except (httpx.HTTPError, ValueError):
        return ""
    parts = [f"{s.labels['owner']} {s.value / 2**20:.0f}" for f in families for s in f.samples
             if s.name == "cellserve:memory_bytes"]
    rss = [s.value for f in families for s in f.samples if s.name == "process_resident_memory_bytes"]
    return ", ".join(([f"rss {rss[0] / 2**20:.0f}"] if rss else []) + parts)


def main(argv: list[str] | None = None) -> int:
    """`cellserve bench serve ARGS...`: `argv` holds the ARGS (a leading 'serve' is accepted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return run_args(args, command=shlex.join(["cellserve", "bench", "serve", *argv]))


def main_with_subcommand(argv: list[str]) -> int:
    """`python -m server.bench serve ARGS...`: requires the `serve` subcommand."""
    if argv[:1] != ["serve"]:
        print("usage: python -m server.bench serve [--url URL] [...]; "
              "run `python -m server.bench serve --help` for every flag", file=sys.stderr)
        return 2
    return main(argv[1:])
