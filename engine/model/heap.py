"""Give the heap pages a model load freed back to the OS (glibc's `malloc_trim`).

A load allocates and frees several copies of the weights on the way (a GGUF file's blocks read, repacked into
the kernels' rows, laid out in tiles; a float folder's tensors converted), and glibc keeps freed heap memory
for reuse rather than returning it: a SmolLM2-1.7B-shaped Q8_0 file left the process with 3.9 GB of anonymous
memory resident after its load, 2.0 GB once trimmed (the weights are 1.7 GB). So `ModelRunner.from_pretrained`
ends with `trim()`. Where the C library has no `malloc_trim` (musl, macOS) it does nothing.
"""

from engine.api.memory import malloc_trim


def trim() -> bool:
    """Return the free heap memory to the OS; False where this C library cannot."""
    return malloc_trim()
