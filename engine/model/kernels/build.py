"""The native forward's fused CPU kernels (`engine/model/kernels/csrc/*.cpp`): built once, or not at all.

`load()` compiles the kernels with torch's `cpp_extension` the first time any process asks (~15 s on
2 cores; `make` does it at install) and caches the build under `~/.cache/cellserve/kernels/`, keyed by
the source, torch's version, the CPU's flags and the compiler flags. Anything that stops the build
(no compiler, no ninja, `CELLSERVE_KERNELS=0`) leaves `load()` False with the reason in `why_not()`,
and the native forward runs the same math in eager torch ops instead: the kernels are a speed-up,
never a requirement.

An image carries ready builds for several CPU levels instead (variants.py): with
`CELLSERVE_KERNELS_PREBUILT=DIR`, `load()` loads the best one this CPU runs and builds nothing (no compiler
needed); none fits: the build above, as without it.
"""

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from engine.model.kernels import variants

log = logging.getLogger("cellserve.kernels")

SOURCES = tuple(Path(__file__).parent / "csrc" / name
                for name in ("cell_kernels.cpp", "small_linear.cpp", "packed_linear.cpp", "quant_linear.cpp",
                             "quant_krows.cpp", "quant_experts.cpp", "quant_gemm.cpp", "quant_tiles.cpp",
                                 "amx_linear.cpp", "lora_update.cpp"))
HEADERS = tuple(sorted((Path(__file__).parent / "csrc").glob("*.h")))  # in the cache key, not compiled alone
# -fopenmp: at::parallel_for is inline and runs serially without it; the .so then links libgomp.so.1,
# which resolves to the copy torch has already loaded (same soname), so there is one OpenMP runtime.
# -fno-math-errno lets the softmax's exp vectorize.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
PREBUILT_ENV = "CELLSERVE_KERNELS_PREBUILT"  # a folder of variants.py's builds (docker/Dockerfile sets it)


def load() -> bool:
    """Whether `torch.ops.cellserve` is usable in this process (building it on first use)."""
    return why_not() is None


@functools.cache
def why_not() -> str | None:
    """Why the kernels are off, or None when they are on (building them on first use, once a process)."""
    why = _build()
    if why is not None:
        log.warning("fused CPU kernels off (%s); the native forward uses eager ops", why)
    else:
        log.info("fused CPU kernels on")
    return why


def _build() -> str | None:
    if os.environ.get("CELLSERVE_KERNELS") == "0":
        return "CELLSERVE_KERNELS=0"
    if os.environ.get(PREBUILT_ENV):
        found = variants.pick(Path(os.environ[PREBUILT_ENV]), variants.sources_key(SOURCES + HEADERS))
        if found is not None:
            return _load_prebuilt(*found)
    try:
        from torch.utils import cpp_extension
    except ImportError as e:  # pragma: no cover - torch always ships it
        return f"torch.utils.cpp_extension: {e}"
    # ninja may sit beside this interpreter (the `ninja` wheel) rather than on PATH
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja)"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++) on PATH"
    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(build_dir):
            cpp_extension.load(
                name="cellserve_kernels", sources=[str(s) for s in SOURCES], build_directory=str(build_dir),
                extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    # a compile error (RuntimeError), a compiler that fails even `--version` (CalledProcessError), a missing
    # file: the build falls back to eager ops, never takes the server down
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        return "build failed: " + next((line for line in lines if "error" in line), lines[-1])
    return None


def _load_prebuilt(variant: variants.Variant, lib: Path) -> str | None:
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as e:
        return f"the prebuilt {variant.name} kernels did not load: {e}"
    log.info("fused CPU kernels: the prebuilt %s build (%s)", variant.name, lib)
    return None


def build_directory() -> Path:
    """Where this source, torch and CPU's build lives (-march=native: a build belongs to the CPU's
    instruction set as much as to the source and torch). The sources' folder is part of the key: ninja
    rebuilds when the same files come from another path, so two checkouts sharing one directory would
    rebuild it in turn at every start (a minute or more each)."""
    tag = f"{torch.__version__} {_cpu_flags()} {_CFLAGS} {SOURCES[0].resolve().parent}"
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + tag.encode()).hexdigest()[:16]
    return Path(os.environ.get("CELLSERVE_KERNEL_CACHE", Path.home() / ".cache" / "cellserve" / "kernels")) / key


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """One build per directory at a time, by an flock the kernel drops when its holder dies. torch's own
    lock is a file that a killed build leaves behind, and every later start would then wait on it
    forever; whoever holds the flock is the only one building, so such a file is stale and goes."""
    with open(build_dir / "cellserve.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)  # torch's FileBaton, left by a killed build
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cpu_flags() -> str:
    """This CPU's instruction-set flags (Linux), else torch's coarse capability name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def build_variants(root: Path) -> None:
    """`--variants DIR`: compile every CPU level of variants.py into DIR (an image's build stage)."""
    bindir = str(Path(sys.executable).parent)  # ninja beside this interpreter, as in _build
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    variants.build_all(root, SOURCES, variants.sources_key(SOURCES + HEADERS), _CFLAGS)


if __name__ == "__main__":  # `python -m engine.model.kernels.build`: build now (make does this at install)
    logging.basicConfig(level=logging.INFO)
    if sys.argv[1:2] == ["--variants"] and len(sys.argv) == 3:
        build_variants(Path(sys.argv[2]))
    else:
        print("fused CPU kernels:", "on" if load() else f"off ({why_not()})")
