"""Keep the heap from holding what a load or a step freed (glibc's `malloc_trim` and `mallopt`).

A load allocates and frees several copies of the weights on the way (a GGUF file's blocks read, repacked into
the kernels' rows, laid out in tiles; a float folder's tensors converted), and glibc keeps freed heap memory
for reuse rather than returning it: a SmolLM2-1.7B-shaped Q8_0 file left the process with 3.9 GB of anonymous
memory resident after its load, 2.0 GB once trimmed (the weights are 1.7 GB). So `ModelRunner.from_pretrained`
ends with `trim()`.

It starts with `cap()`: glibc's mmap threshold is dynamic, rising to the largest chunk freed so far (up to
32 MiB), so once a load or a prefill has freed a 28 MiB activation, every later tensor below that size comes
from the arenas, and a burst's transient tensors stay there, resident, as `allocator_free`. A fixed threshold
of `MMAP_THRESHOLD` (4 MiB: a prefill's activations, bf16 weight tiles and many rows' logits are mapped and
unmapped; a decode step's small tensors still reuse the heap) keeps peak RSS near what is live: Gemma-3-1B's
shape, Q4_K_M, 8,192 int8 cells, one process through start-up, warm-up and 8 x (64 + 24) tokens (2026-12-08):
VmHWM 1,314 MB with 214 MB of it free in the arenas at the end; 1,201 MB and 13 MB at a 256 KiB threshold.
`CELLSERVE_MALLOC_MMAP_THRESHOLD` sets the bytes (0: glibc's dynamic threshold); a `MALLOC_MMAP_THRESHOLD_`
in the environment (glibc's own) is left alone. Where the C library is not glibc both do nothing.
"""

import os

from engine.api.memory import malloc_trim, mmap_threshold

MMAP_THRESHOLD = 4 << 20
ENV = "CELLSERVE_MALLOC_MMAP_THRESHOLD"


def cap() -> bool:
    """Fix malloc's mmap threshold (module docstring); False when left to glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        nbytes = int(os.environ.get(ENV, MMAP_THRESHOLD))
    except ValueError:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: give a number of bytes (0: glibc's dynamic threshold)") from None
    return nbytes > 0 and mmap_threshold(nbytes)


def trim() -> bool:
    """Return the free heap memory to the OS; False where this C library cannot."""
    return malloc_trim()
