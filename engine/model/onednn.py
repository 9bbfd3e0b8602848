"""Bounds on oneDNN's primitive caches, set before the first primitive is made (issue #47).

oneDNN compiles one primitive per (rows, weight shape, epilogue) of a matmul and keeps it for the next call of
that shape: ideep (torch's oneDNN wrapper) in a per-thread LRU of `LRU_CACHE_CAPACITY` entries, oneDNN itself in
a process-wide one of `ONEDNN_PRIMITIVE_CACHE_CAPACITY`; both default to 1,024. A step's row count is any number
up to `--max-num-batched-tokens` (chunked prefills, `n` choices, drafts), so a burst of varied prompts fills them
with primitives of shapes seen once: measured 0.3 MiB each after a trim, +180 MiB for 640 shapes, and a server
grew by 100-130 MiB a burst until the caches were full (docs/performance.md, "A burst, and what comes back").
At 128 and 64 entries they hold ~45 MiB at most on the bundled model and ~105 MiB at SmolLM2-1.7B's shapes (its
prefill's bf16 tiles, ~0.8 MiB a primitive), which one burst reaches, and still keep every shape a steady decode
batch uses (a handful of linears x the few row counts it alternates between); a miss costs one compile, ~3 ms,
where the step needs a new shape anyway. Set by environment variable, since neither torch nor ideep exposes
a call for them; a value already in the environment wins.
"""

import os

CAPACITIES = {"LRU_CACHE_CAPACITY": "128", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


def cap_primitive_caches() -> None:
    """Set the caches' capacities unless the environment names them (read by oneDNN at its first primitive and
    by ideep at each thread's first, so this must run before the model's first matmul)."""
    for name, value in CAPACITIES.items():
        os.environ.setdefault(name, value)
