"""Where a benchmark ran: the one machine description every benchmark prints and saves (torch-free).

The load generator (server/bench) runs where torch may be absent; the engine benchmarks run with torch
loaded and add its version and thread count, read after `torch.set_num_threads`.
"""

import os
import platform
import sys


def machine_info() -> dict:
    """Platform, CPU, Python and host; torch's version and threads when torch is loaded."""
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "hostname": platform.node(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}
    torch = sys.modules.get("torch")
    if torch is not None:
        info.update(torch=torch.__version__, threads=torch.get_num_threads())
    return info


def machine() -> str:
    """`machine_info` on one line."""
    m = machine_info()
    threads = f"{m['threads']} torch threads of " if "threads" in m else ""
    torch = f" | torch {m['torch']}" if "torch" in m else ""
    return f"{m['platform']} | {m['processor']} | {threads}{m['cpu_count']} CPUs{torch}"
