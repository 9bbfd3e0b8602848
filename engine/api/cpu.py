"""What `--dtype auto` means for a float model on this CPU: the one place the CPU is probed (torch-free).

bfloat16 halves the bytes every decode step streams and, where the CPU multiplies bf16 natively
(AVX512-BF16's `vdpbf16ps`, or AMX tiles under oneDNN), runs the matmuls at least as fast as float32:
about twice float32's tok/s on SmolLM2 (docs/performance.md, issue 26). Without those units torch
emulates bf16 through float32 conversions and is slower than float32, so "auto" is float32 there.
The flags are Linux's /proc/cpuinfo names (the same ones torch's and oneDNN's dispatch test); a CPU
without that file (macOS, Windows) counts as having neither. Torch-free, so the CLI's help, the engine's
loader and the benchmarks' machine line all read the same answer.
"""

import functools
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # either one: oneDNN's bf16 matmuls run natively


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (the first `flags` line of /proc/cpuinfo, or of the text given)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def auto_float_dtype(flags: frozenset[str] | None = None) -> str:
    """The dtype "auto" loads a float (non-quantized) model in: "bfloat16" when the CPU has native bf16
    matmuls (any of `BF16_FLAGS`), else "float32". `flags` defaults to this CPU's."""
    flags = _this_cpu() if flags is None else flags
    return "bfloat16" if any(f in flags for f in BF16_FLAGS) else "float32"


@functools.cache
def _this_cpu() -> frozenset[str]:
    return cpu_flags()
