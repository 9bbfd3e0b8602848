"""Where a server's resident bytes are: the report's shape, and the process-level readings (torch-free).

`MemoryReport` is what `Engine.memory()` / `AsyncEngine.memory()` answer, what `/metrics` exports as
`cellserve:memory_bytes{owner=...}`, what the startup log and `cellserve bench` print. The owners:

- `weights`: the tensors the forward holds (quantized blocks, packed float weights, norms, embeddings);
- `cell_pool`: the KV pools (`n_cells` x bytes a cell, the draft model's pool included);
- `step_buffers`: the most one step may allocate (activations, attention, logits and sampling for
  `--max-num-batched-tokens` rows): a bound from the model's shape (engine/core/memory.py's formula), not a
  reading, since a step's tensors live only while it runs;
- `grammar_cache`, `prefix_index`, `tokenizer`: the caches (compiled grammars, the prefix index's block
  hashes, the tokenizer's vocabulary and merges as serialized);
- `lora_adapters`: the resident LoRA adapters' A and B matrices (each one's bytes: `/v1/models`,
  `cellserve:lora_adapter_bytes{adapter}`);
- `allocator_free`: bytes glibc's malloc holds in its arenas but nothing uses (`mallinfo2().fordblks`): what
  a burst leaves behind, and what `malloc_trim` can give back;
- `rss`, `peak_rss`: the process's VmRSS and VmHWM; `other` is `rss` less weights, pool and caches: the
  runtime (Python, torch and its libraries, requests in flight) and whatever of `allocator_free` is still
  resident (glibc counts a trimmed chunk as free whether or not its pages went back).

Hand-written with ctypes because neither psutil nor the standard library exposes glibc's `mallinfo2` or
`malloc_trim`; where the C library is not glibc (musl, macOS) both report "unknown" (None / False).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class MemoryReport:
    """Resident memory by owner, in bytes. Guarantees: every field is >= 0; `owners()` gives the fixed set of
    owner names `/metrics` labels (so a dashboard's series never change name)."""

    weights: int
    cell_pool: int
    step_buffers: int  # a bound (see the module docstring), not a reading
    caches: dict[str, int] = field(default_factory=dict)  # grammar_cache, prefix_index, tokenizer, lora_adapters
    allocator_free: int = 0
    rss: int = 0
    peak_rss: int = 0

    @property
    def other(self) -> int:
        """RSS not accounted to weights, pool or caches (the runtime, the allocator's resident free bytes)."""
        return max(0, self.rss - self.weights - self.cell_pool - sum(self.caches.values()))

    def owners(self) -> dict[str, int]:
        return {"weights": self.weights, "cell_pool": self.cell_pool, "step_buffers": self.step_buffers,
                **self.caches, "allocator_free": self.allocator_free, "other": self.other}

    def lines(self) -> str:
        """One human line: 'rss 812 MiB (peak 901): weights 97, cell_pool 200, ...'."""
        mib = 1 << 20
        parts = ", ".join(f"{k} {v / mib:.0f}" for k, v in self.owners().items())
        return f"rss {self.rss / mib:.0f} MiB (peak {self.peak_rss / mib:.0f}): {parts} (MiB; step_buffers is the bound)"


def process_rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes; (0, 0) where /proc is missing."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return 0, 0
    values = {}
    for line in text.splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            values[line[:5]] = int(line.split()[1]) * 1024
    return values.get("VmRSS", 0), values.get("VmHWM", 0)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def allocator_free() -> int | None:
    """Bytes free in malloc's arenas (glibc `mallinfo2().fordblks`, every arena); None elsewhere."""
    fn = getattr(_libc(), "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _Mallinfo2
    return int(fn().fordblks)


def malloc_trim() -> bool:
    """Give malloc's free pages back to the OS (glibc `malloc_trim(0)`: every arena, the middle of the heap
    too); False where the C library has none."""
    fn = getattr(_libc(), "malloc_trim", None)
    if fn is None:
        return False
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    fn(0)
    return True


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def mmap_threshold(nbytes: int) -> bool:
    """Serve every malloc of `nbytes` or more by its own mmap, unmapped when freed (glibc
    `mallopt(M_MMAP_THRESHOLD)`; a fixed threshold also ends glibc's dynamic one, which rises to the largest
    chunk freed so far, up to 32 MiB, and then keeps such chunks in the arenas); False where the C library
    has no `mallopt`."""
    fn = getattr(_libc(), "mallopt", None)
    if fn is None:
        return False
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(fn(M_MMAP_THRESHOLD, int(nbytes)))
