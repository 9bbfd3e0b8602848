"""Skipping a test of a CPU feature the processor does not have: the one skip a complete run lets stand.

`tests/conftest.py` turns every other skip into a failure under CI / CELLSERVE_NO_SKIP. A test of AMX's
bitwise row invariance cannot run on an AMD EPYC, whatever is installed; it runs wherever the CPU has the
feature. Where the CPU has it and the build still cannot use it, the test fails: that is a broken build.
"""

from pathlib import Path

import pytest

from engine.model.native.linear import amx_available


def cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo lists for the first processor (empty where there is no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def require_amx(why: str) -> None:
    """Skip (reason "this CPU lacks AMX ...") on a CPU without AMX tiles; on one with them, the fused
    kernels' AMX path must be usable, or the test fails here."""
    if "amx_tile" not in cpu_flags():
        pytest.skip(f"this CPU lacks AMX (no amx_tile in /proc/cpuinfo): {why}")
    assert amx_available(), "the CPU has AMX but the fused kernels' amx_linear is not usable (a broken build)"
