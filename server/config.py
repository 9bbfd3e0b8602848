"""The one place the command line meets the engine: parsed `cellserve` flags become the `EngineArgs`, the
`Limits` and the engine factory that the single server and every Ray Serve replica are built from.

Everything here that touches the engine beyond `engine.api` (building an `AsyncEngine`, the model
cache of `engine.loader.source`) is imported inside the function that needs it, so importing this
module (and the CLI) never imports torch.
"""

import argparse
import logging
from collections.abc import Callable

from engine.api.args import EngineArgs
from server.limits import Limits

log = logging.getLogger("cellserve")
# Idle keep-alive connections are closed after this long. Well above common clients' own pool expiry
# (httpx: 5 s), so a client never reuses a connection at the instant the server closes it (ReadError).
KEEP_ALIVE_S = 30


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def engine_args_of(args: argparse.Namespace) -> EngineArgs:
    """The serve flags as the one `EngineArgs` every engine is built from."""
    return EngineArgs(model=args.model, dtype=args.dtype, quantize=args.quantize,
                      kv_cache_dtype=args.kv_cache_dtype, n_cells=args.n_cells,
                      kv_memory_bytes=args.kv_memory,
                      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_queue=args.max_queue, seq_ttl_s=args.seq_ttl, threads=args.threads,
                      attention=args.attention, prefix_caching=not args.no_prefix_cache,
                      speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                      draft_model=args.draft_model, draft_dtype=args.draft_dtype,
                      state_dir=args.state_dir, state_max_bytes=args.state_max_bytes, state_eager=args.state_eager,
                      warmup=not args.no_warmup, lora_modules=_lora_modules(args.lora),
                      max_loras=args.max_loras, max_lora_memory=args.max_lora_memory)


def _lora_modules(pairs: list[tuple[str, str]]) -> dict[str, str]:
    names = [name for name, _ in pairs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"--lora {dup}=... is given twice: each adapter needs its own name")
    return dict(pairs)


def engine_factory(args: argparse.Namespace) -> Callable[[], object]:
    """A zero-argument builder the app calls in a worker thread (model loading takes seconds)."""

    def build():
        from engine.core.async_engine import AsyncEngine  # torch-heavy; only when serving
        from engine.loader.source import resolve_args

        # a .gguf is converted once, a known name pulled once
        engine_args, name = resolve_args(engine_args_of(args))
        log.info("loading model %s from %s%s", name, engine_args.model, "" if args.model else " (the bundled model)")
        engine = AsyncEngine.from_args(engine_args, model_name=name)
        if engine_args.draft_model is not None:
            log.info("draft model %s (dtype %s) drafts for speculative decoding", engine_args.draft_model, args.draft_dtype)
        pool = engine.n_cells * engine.cell_bytes
        log.info("loaded %s (%s%s, context %d tokens); cell pool: %d cells x %d B = %s (KV %s); prefix cache %s",
                 engine.model_name, engine.dtype, _quantized(args.quantize), engine.max_model_len, engine.n_cells,
                 engine.cell_bytes, human_bytes(pool), engine.kv_cache_dtype,
                 "on" if engine.prefix_caching else "off (--no-prefix-cache)")
        log.info("memory: %s", engine.memory().lines())
        return engine

    return build


def _quantized(mode: str) -> str:
    return "" if mode == "none" else f", linears quantized to {mode}"


def state_dir_of(args: argparse.Namespace) -> str | None:
    """`--state-dir`: the engine keeps its sequences there (`EngineArgs.state_dir`), the server its stored
    responses (`DIR/responses`, server/responses/saved.py); None: memory only."""
    return args.state_dir


def limits_of(args: argparse.Namespace) -> Limits:
    """The serve flags' request limits (`--max-body-bytes`, `--max-header-bytes`, `--max-prompts`,
    `--max-choices`)."""
    return Limits(max_body_bytes=args.max_body_bytes, max_prompts=args.max_prompts,
                  max_choices=args.max_choices, max_header_bytes=args.max_header_bytes)


def pull(name: str, dtype: str):
    """`cellserve pull NAME`: the model's folder in the cache, fetched or converted once
    (`engine.loader.source.resolve_model`; raises `ModelSourceError`)."""
    from engine.loader.source import resolve_model

    return resolve_model(name, dtype)


def model_cache() -> tuple[str, list[dict], list]:
    """`cellserve models`: the cache folder, the converted models in it, the known models not pulled yet."""
    from engine.loader.source import KNOWN_MODELS, cached_models, cellserve_home

    rows = cached_models()
    pulled = {r.get("name") for r in rows}
    return str(cellserve_home()), rows, [spec for spec in KNOWN_MODELS.values() if spec.name not in pulled]
