"""Ready builds of the fused CPU kernels for named CPU levels, so an image carries kernels for CPUs other
than the one it was built on, and its runtime needs no compiler.

`make` builds the kernels with `-march=native` for the machine it runs on (build.py). An image is built
on one machine and run on others, so docker/Dockerfile's build stage runs

    python -m engine.model.kernels.build --variants /opt/cellserve/kernels

which compiles one build per row of `VARIANTS` (each with explicit `-m` flags instead of `-march=native`,
compiled only, never loaded: the build machine need not have the instructions) into `DIR/<name>/`, with a
`variant.json` naming the sources' hash and torch's version. At start, `pick(DIR)` returns the best build
whose CPU flags this CPU has (`/proc/cpuinfo`) and whose sources and torch match this install; build.py
loads it with `torch.ops.load_library` and builds nothing (`CELLSERVE_KERNELS_PREBUILT=DIR`).

The level list follows the kernels' own `#if defined(__AVX512BF16__)`, `__AVX512VNNI__`, `__GFNI__`,
`__AMX_TILE__` branches (csrc/): each row turns on more of them. A CPU below the last row gets no
prebuilt kernels, and build.py's ordinary path decides (a compiler there builds for it; none: eager ops).

Hand-written on torch's `cpp_extension`: its public `load()` always loads what it builds, which would run a
level's code on a build machine that may lack it, so the compile-only step calls the private
`_write_ninja_file_and_build_library` of the pinned torch (the same ninja file `load()` writes).
"""

import hashlib
import json
import logging
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("cellserve.kernels")

NAME = "cellserve_kernels"  # the library's name, as build.py's load() names it


@dataclass(frozen=True)
class Variant:
    """One CPU level: the compiler's target flags and the /proc/cpuinfo flags a CPU needs to run them."""

    name: str
    cflags: tuple[str, ...]
    needs: frozenset[str]


_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")  # x86-64-v3 in cpuinfo's names
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")      # x86-64-v4
_BF16 = _V4 + ("avx512_vnni", "avx512vbmi", "avx512_bf16", "gfni")  # the quantized kernels' VNNI path reads
# bytes with vpermb (VBMI)

# AMX is compiled into the BF16 level: amx_linear_fast() asks the kernel for the tile state at run time
# (arch_prctl), which a CPU without AMX refuses, and the compiler never emits AMX code on its own; so one build
# serves Zen 4 and Sapphire Rapids alike, and the image compiles three levels, not four
_BF16_FLAGS = ("-march=x86-64-v4", "-mavx512vnni", "-mavx512vbmi", "-mavx512bf16", "-mgfni", "-mamx-tile",
               "-mamx-bf16")

VARIANTS: tuple[Variant, ...] = (  # best first
    Variant("avx512-bf16", _BF16_FLAGS, frozenset(_BF16)),
    Variant("avx512", ("-march=x86-64-v4",), frozenset(_V4)),
    Variant("avx2", ("-march=x86-64-v3",), frozenset(_V3)),
)


def cflags(variant: Variant, base: list[str]) -> list[str]:
    """build.py's flags (`base`) with the variant's target in place of -march=native."""
    return [f for f in base if f != "-march=native"] + list(variant.cflags)


def sources_key(files: tuple[Path, ...]) -> str:
    """The sources', headers' and torch's identity: a build from other sources or another torch is stale."""
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files) + torch.__version__.encode())
    return digest.hexdigest()[:16]


def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def pick(root: Path, key: str, flags: frozenset[str] | None = None) -> tuple[Variant, Path] | None:
    """The best ready build under `root` of the sources `key` this CPU runs (and its library), or None
    (logged: why)."""
    flags = cpu_flags() if flags is None else flags
    for variant in VARIANTS:
        if not variant.needs <= flags:
            continue
        lib, meta = root / variant.name / f"{NAME}.so", root / variant.name / "variant.json"
        if not lib.is_file() or not meta.is_file():
            log.warning("no prebuilt %s kernels in %s; building for this CPU instead", variant.name, root)
            return None
        if json.loads(meta.read_text()).get("sources") != key:
            log.warning("the prebuilt %s kernels in %s are from other sources or another torch; ignored",
                        variant.name, root)
            return None
        return variant, lib
    log.warning("this CPU has none of the prebuilt kernels' levels (%s); building for it instead",
                ", ".join(v.name for v in VARIANTS))
    return None


def build_all(root: Path, sources: tuple[Path, ...], key: str, base_cflags: list[str]) -> None:
    """Compile every variant of `sources` into `root/<name>/` (never loaded here)."""
    from torch.utils import cpp_extension

    for variant in VARIANTS:
        start, cpu = time.monotonic(), _children_cpu_s()
        out = root / variant.name
        out.mkdir(parents=True, exist_ok=True)
        flags = cflags(variant, base_cflags)
        cpp_extension._write_ninja_file_and_build_library(
            NAME, [str(s) for s in sources], flags, None, None, ["-fopenmp"], None, str(out),
            verbose=False, with_cuda=False, with_sycl=False)
        (out / "variant.json").write_text(json.dumps({"variant": variant.name, "sources": key,
                                                      "cflags": flags}) + "\n")
        for scratch in out.glob("*.o"):
            scratch.unlink()
        print(f"built {variant.name}: {out / (NAME + '.so')} in {time.monotonic() - start:.0f} s "
              f"({_children_cpu_s() - cpu:.0f} s of compiler CPU time)", flush=True)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
