"""Which CPU features this processor has, for tests whose exact guarantee depends on one (AMX).

A test of a guarantee that holds only with a feature checks it bitwise where the CPU has the feature, and
checks what the code promises instead where it has not (a test never skips for a CPU feature: CI's
machine is an AMD EPYC without AMX). Where the CPU has AMX and the build cannot use it, the test fails.
"""

from pathlib import Path

from engine.model.native.linear import amx_available


def cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo lists for the first processor (empty where there is no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def has_amx() -> bool:
    """Whether this CPU has AMX tiles; where it has them, the fused kernels' AMX path must be usable."""
    if "amx_tile" not in cpu_flags():
        assert not amx_available(), "amx_linear claims AMX on a CPU whose flags have no amx_tile"
        return False
    assert amx_available(), "the CPU has AMX but the fused kernels' amx_linear is not usable (a broken build)"
    return True
