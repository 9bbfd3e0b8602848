"""`cellserve`: the command line. `cellserve serve ...` runs the HTTP server; `cellserve bench serve|engine
...` runs the benchmarks (imported lazily so the server never pays for them).

`serve` opens the socket first and loads the model in a worker thread, so `/health` answers 503 while
it loads; if loading fails the process exits with status 1 and says why. SIGTERM/SIGINT stop
admitting new requests (503), let in-flight ones finish for `--shutdown-grace` seconds, cancel what
is left, shut the engine down and exit 0.
"""

import argparse
import logging
import os
import re
import signal
import sys
import threading

from engine.api.args import KV_CACHE_DTYPES, QUANTIZE_MODES, EngineArgs
from engine.api.cpu import auto_float_dtype
from server.config import (
    KEEP_ALIVE_S,
    engine_factory,
    human_bytes,
    limits_of,
    model_cache,
    pull,
    state_dir_of,
)
from server.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CHOICES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_PROMPTS,
)

log = logging.getLogger("cellserve")
ENGINE = EngineArgs()  # the engine flags' defaults
SHUTDOWN_SLACK_S = 10  # after SIGTERM, the process exits at most this long after the grace period

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1048576' -> 1048576."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 2GiB, 512MiB, 1.5GB or a byte count")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _lora_module(text: str) -> tuple[str, str]:
    """`--lora NAME=PATH`."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=PATH (the name requests use as their model)")
    return name, path


def _replicas(text: str) -> str:
    from server.ray_serve.routing import parse_replicas  # no Ray: the flag is checked before Ray is imported

    try:
        parse_replicas(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    p.add_argument("--model", default=None, help="Hugging Face model folder, .gguf file or known model name "
                   "(see `cellserve models`; default: the bundled model, nothing fetched)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--n-cells", type=_positive_int, default=None, help="KV cells in the pool (tokens)")
    pool.add_argument("--kv-memory", type=parse_size, default=None, help="KV pool budget, e.g. 2GiB")
    p.add_argument("--max-num-seqs", type=_positive_int, default=ENGINE.max_num_seqs, help="sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=ENGINE.max_num_batched_tokens,
                   help="token budget per tick")
    p.add_argument("--max-queue", type=_positive_int, default=ENGINE.max_queue, help="waiting requests before 429")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but "
                   "/health, /metrics and the chat page")
    p.add_argument("--cors-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="origins whose web pages may call the server (e.g. http://localhost:3000; '*': any, then "
                        "without credentials); default: none, same-origin pages only")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this PEM private key (with --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this PEM certificate (chain)")
    p.add_argument("--pooling", default=None, choices=["last", "mean", "cls"],
                   help="how /v1/embeddings (and /v1/rerank, /v1/score) pool a text's final hidden states into one "
                        "vector (default: last, the token that has read the whole text)")
    p.add_argument("--rerank-mode", default="cosine", choices=["cosine", "yes-no"],
                   help="how /v1/rerank and /v1/score score a (query, document) pair: cosine of their vectors "
                        "(default), or yes-no: P(yes) from the model's 'yes'/'no' logits after a judging prompt, "
                        "as Qwen3-Reranker-style causal rerankers are served")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    p.add_argument("--dtype", default=ENGINE.dtype, choices=["auto", "float32", "bfloat16", "float16", "quantized"],
                   help="model dtype (auto: a float model in bfloat16 on CPUs with AVX512-BF16 or AMX, "
                        f"float32 elsewhere (this CPU: {auto_float_dtype()}), and a quantized .gguf of a "
                        "Llama/Qwen2 model served quantized; quantized: a .gguf's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K "
                        "blocks run as they are, the file's bytes in memory; float32/bfloat16: a .gguf "
                        "dequantized to it once; bfloat16 is ~2x faster than float32 on CPUs with AVX512-BF16)")
    p.add_argument("--quantize", default=ENGINE.quantize, choices=list(QUANTIZE_MODES),
                   help="quantize a float folder's linears at load, weight-only in blocks of 32 (int8: Q8_0, "
                        "~1/4 of float32's bytes; int4: Q4_1, ~1/6; the LM head Q8_0) and run them on the "
                        "quantized kernels; Llama/Mistral/Qwen2 models; not with a GGUF served quantized")
    p.add_argument("--kv-cache-dtype", default=ENGINE.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                   help="KV cells' storage (int8: int8 with a float32 scale per cell and kv head, about half of "
                        "bf16's bytes, so a --kv-memory budget holds ~2x the cells; model: the model's dtype; "
                        "auto: int8 when the weights are quantized (a .gguf served from its blocks, --quantize), "
                        "the model's dtype otherwise)")
    p.add_argument("--attention", default=ENGINE.attention, choices=["fast", "reference"],
                   help="fast: read only visible cells (default); reference: dense mask over the pool")
    p.add_argument("--served-model-name", default=None, help="model id reported by the API")
    p.add_argument("--seq-ttl", type=float, default=ENGINE.seq_ttl_s, help="seconds before an idle sequence expires")
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--speculative", default=ENGINE.speculative, choices=["auto", "ngram", "off"],
                   help="speculative decoding with drafts from each sequence's own history and its siblings' "
                        "(output unchanged): auto drafts while at most 4 sequences decode, ngram always, off never")
    p.add_argument("--num-speculative-tokens", type=_positive_int, default=ENGINE.num_speculative_tokens,
                   help="the longest draft a sequence carries into one step (1-16)")
    p.add_argument("--draft-model", default=ENGINE.draft_model,
                   help="a draft model of the target's tokenizer (a folder, a .gguf file or a known name, as "
                        "--model): drafts where no n-gram draft exists, on its own cell pool (speculative auto/ngram)")
    p.add_argument("--draft-dtype", default=ENGINE.draft_dtype, choices=["auto", "float32", "bfloat16", "float16", "quantized"],
                   help="the draft model's dtype, as --dtype (auto: a .gguf's own quantized blocks where they run)")
    p.add_argument("--lora", action="append", type=_lora_module, default=[], metavar="NAME=PATH",
                   help="a LoRA adapter (a PEFT folder or a llama.cpp LoRA .gguf) loaded at start, served as model "
                        "NAME (repeatable; llama.cpp's ids 0, 1, ... in this order)")
    p.add_argument("--max-loras", type=_positive_int, default=ENGINE.max_loras,
                   help="LoRA adapters resident at once (the least recently used one not in use is unloaded)")
    p.add_argument("--max-lora-memory", type=parse_size, default=None,
                   help="bytes the resident adapters may take, e.g. 512MiB (a load beyond it: 507); default: no limit")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="turn automatic prefix sharing off (finished requests free their cells at once)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip running the first steps' shapes once at load (the first request then pays the "
                        "one-time costs)")
    p.add_argument("--state-dir", default=None,
                   help="keep persistent sequences (tokens, and idle ones' KV cells) in this folder and restore them "
                        "on start; default: memory only")
    p.add_argument("--state-max-bytes", type=parse_size, default=None,
                   help="cap on the state dir's cell files, e.g. 20GiB: least recently used fork families drop "
                        "their cells (tokens kept, recomputed when used)")
    p.add_argument("--state-eager", action="store_true",
                   help="load restored sequences' cells at start (as far as the pool has room) rather than when "
                        "each is next used")
    p.add_argument("--max-body-bytes", type=parse_size, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted (413 beyond, unread), e.g. 8MiB")
    p.add_argument("--max-header-bytes", type=parse_size, default=DEFAULT_MAX_HEADER_BYTES,
                   help="largest request line + headers accepted (431 beyond; one line or the URL: an eighth "
                        "of it, 414 for the URL), e.g. 64KiB")
    p.add_argument("--max-prompts", type=_positive_int, default=DEFAULT_MAX_PROMPTS,
                   help="prompts in one completions request (400 beyond)")
    p.add_argument("--max-choices", type=_positive_int, default=DEFAULT_MAX_CHOICES,
                   help="choices (prompts x n) in one request (400 beyond)")
    p.add_argument("--no-ui", action="store_true", help="do not serve the chat page at / (GET / is then 404)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    scale = p.add_argument_group("scale-out on Ray Serve (pip install 'cellserve[ray]')")
    scale.add_argument("--replicas", type=_replicas, default=None,
                       help="N engine replicas, or auto:MIN-MAX (Serve's autoscaling), behind Ray Serve's HTTP "
                            "proxy on --host:--port; see README 'Scale-out'")
    scale.add_argument("--target-ongoing-requests", type=_positive_int, default=8,
                       help="with --replicas auto:MIN-MAX: requests per replica Serve's autoscaler aims at")
    scale.add_argument("--downscale-delay", type=float, default=60.0,
                       help="with --replicas auto:MIN-MAX: seconds of low load before a replica is removed "
                            "(its sequences move to the others first)")
    scale.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local Ray)")
    scale.add_argument("--threads-per-replica", type=_positive_int, default=None,
                       help="torch threads (and Ray CPUs) per replica")
    return p


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from server.app import build_app
    from server.http_edge import uvicorn_options
    from server.memory import idle_trim_from_env

    failed: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(reason: str) -> None:  # the model failed to load, or the engine loop died
        failed.append(reason)
        if server is not None:
            server.should_exit = True

    app = build_app(engine_factory(args), served_model_name=args.served_model_name, api_key=args.api_key,
                    shutdown_grace_s=args.shutdown_grace, on_fatal=on_fatal, limits=limits_of(args),
                    ui=not args.no_ui, state_dir=state_dir_of(args), cors_origins=args.cors_origins,
                    pooling=args.pooling, rerank_mode=args.rerank_mode)
    ctx = app.state.ctx
    ctx.metrics.memory.trim = idle_trim_from_env(ctx.engine_stats)  # malloc_trim once idle (server/memory.py)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT the app stops admitting (503) before uvicorn starts its graceful wait.

        Unlike uvicorn's own handler it does not re-raise the signal after the graceful shutdown, so
        a drained server exits with status 0 (a second SIGINT still forces the exit)."""

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:  # whatever hangs, the process is gone a few seconds after the grace
                watchdog = threading.Timer(args.shutdown_grace + SHUTDOWN_SLACK_S, _exit_now)
                watchdog.daemon = True
                watchdog.start()
            ctx.begin_drain()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_keep_alive=KEEP_ALIVE_S, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, timeout_graceful_shutdown=max(1, int(args.shutdown_grace)),
                            # header limits, JSON refusals, lingering close; refusals counted in /metrics
                            **uvicorn_options(ctx.limits, ctx.metrics.count_edge_refusal))
    server = DrainingServer(config)
    log.info("cellserve listening on %s://%s:%d (model loads in the background; GET /health is 503 "
             "until it is ready)", "https" if args.ssl_certfile else "http", args.host, args.port)
    server.run()
    if failed:
        log.error("exiting with status 1: %s", failed[0])
        return 1
    return 0


def _exit_now() -> None:
    log.error("shutdown did not finish within --shutdown-grace + %d s; exiting now", SHUTDOWN_SLACK_S)
    logging.shutdown()
    os._exit(1)


def pull_command(name: str, dtype: str) -> int:
    """`cellserve pull NAME`: the folder on stdout; on failure one line on stderr and status 1."""
    from engine.api.errors import ModelSourceError

    try:
        source = pull(name, dtype)
    except ModelSourceError as exc:
        print(f"cellserve pull: {exc}", file=sys.stderr)
        return 1
    dtype_flag = "" if dtype == "auto" else f" --dtype {dtype}"
    print(f"{source.name}: {source.path}\nserve it with: cellserve serve --model {name}{dtype_flag}")
    return 0


def models_command() -> int:
    """`cellserve models`: every converted folder in the cache, then the known names not pulled yet."""
    home, rows, not_pulled = model_cache()
    print(f"cache: {home}")
    print(f"{'NAME':<28} {'DTYPE':<9} {'SIZE':>10}  PATH")
    for r in rows:
        print(f"{r.get('name', '?'):<28} {r.get('dtype', '?'):<9} {human_bytes(r['bytes']):>10}  {r['path']}")
    for spec in not_pulled:
        print(f"{spec.name:<28} {'-':<9} {'-':>10}  not pulled: cellserve pull {spec.name}  ({spec.about})")
    return 0


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in ("serve", "engine", "compare", "overhead"):
        print("usage: cellserve bench {serve,engine,compare,overhead} ...  (serve: load-test an HTTP server; "
              "engine: measure the engine offline; compare: tabulate and plot several serve results; "
              "overhead: server vs offline engine throughput on one workload, in one run)",
              file=sys.stderr)
        return 2
    if argv[0] == "engine":  # offline, in engine/; its --save-model tokenizer knows the load generator's words
        from engine.bench.engine import main as bench_engine
        from server.bench.workloads import WORDS

        return int(bench_engine(argv[1:], words=WORDS) or 0)
    module = f"server.bench.{argv[0]}"
    try:
        mod = __import__(module, fromlist=["main"])
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            print(f"`cellserve bench {argv[0]}` is not available in this build ({module} is missing)",
                  file=sys.stderr)
            return 2
        raise
    return int(mod.main(argv[1:]) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    parser = argparse.ArgumentParser(prog="cellserve", description="Multi-sequence LLM inference server.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub.add_parser("serve", help="run the OpenAI-compatible HTTP server"))
    sub.add_parser("bench", help="benchmarks: `cellserve bench serve|engine|compare|overhead ...`")
    pull = sub.add_parser("pull", help="fetch a known model (or convert a .gguf) into the cache; print its folder")
    pull.add_argument("name", help="a known model name (see `cellserve models`) or a .gguf file")
    pull.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "quantized"],
                      help="quantized: keep the file's blocks (no dequantized copy; Llama/Qwen2 files); "
                           "float32/bfloat16/float16: dequantize to it; auto: quantized where it can be, "
                           "else float32")
    sub.add_parser("models", help="list known and cached models")
    args = parser.parse_args(argv)
    if args.command in ("pull", "models"):
        return pull_command(args.name, args.dtype) if args.command == "pull" else models_command()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        parser.error("--ssl-keyfile and --ssl-certfile go together: pass both (a PEM key and its certificate)")
    if args.replicas is not None and (args.cors_origins or args.ssl_certfile):
        parser.error("--cors-origins and --ssl-* apply to the single server; with --replicas put a TLS/CORS "
                     "proxy in front of Ray Serve's endpoint")
    if args.replicas is not None and args.state_dir is not None:
        parser.error("--state-dir does not work with --replicas yet (replicas would share one folder); use one")
    if args.replicas is not None:  # Ray is imported only here (an optional extra)
        from server.ray_serve.launch import run_replicated

        return run_replicated(args)
    return run_server(args)


if __name__ == "__main__":
    sys.exit(main())
