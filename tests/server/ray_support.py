"""`cellserve serve --replicas ...` as a user runs it, for the Ray Serve tests: started in its own process
group, ready when the aggregated `/health` says every replica is, stopped with SIGTERM, which must make it exit
0 within `STOP_S` and leave none of the processes it started behind (what is left is killed by pid, and the
test fails).
"""

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

STOP_S = 10.0  # SIGTERM of the whole deployment: the bound, on a machine whose cores are its own
READY_S = 240.0  # Ray, Serve and the replicas on 2 loaded cores


def stop_bound(load: float) -> float:
    """`STOP_S` where the machine's cores are the test's; on an oversubscribed machine (a shared box at load
    average 18 on 2 cores took 10.7 s) the same shutdown's few CPU-seconds stretch in wall time, so the bound
    grows with the load per core, up to 3x (30 s: still under the ~35 s of a controller that missed its
    deadline, the failure this guards against)."""
    return STOP_S * min(3.0, max(1.0, load / (os.cpu_count() or 1)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (Ray's gcs_server, raylet, workers, replicas...), from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.add(p)
        except OSError:
            pass
    return out


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def wait_ready(base: str, proc: subprocess.Popen, log: Path, replicas: int | None = None) -> None:
    deadline = time.monotonic() + READY_S
    while True:
        assert proc.poll() is None, f"cellserve serve --replicas exited: {tail(log)}"
        assert time.monotonic() < deadline, f"not ready within {READY_S} s: {tail(log)}"
        try:
            r = httpx.get(base + "/health", timeout=30)
            if r.status_code == 200 and (replicas is None or len(r.json()["replicas"]) == replicas):
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)


@contextmanager
def serving(tmp: Path, model: str, *flags: str, replicas: int | None = 2, env: dict | None = None):
    """Yield the base URL of `cellserve serve --model MODEL FLAGS` once ready; on exit SIGTERM and check."""
    port = free_port()
    log = tmp / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model, "--port", str(port), "--n-cells", "16384",
           "--threads-per-replica", "1", "--served-model-name", "tiny-llama", "--log-level", "warning",
           "--shutdown-grace", "1", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, log, replicas)
        yield base
    finally:
        started = descendants(proc.pid)
        load = os.getloadavg()[0]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own process group: only what this test started
            rc = proc.wait(10)
        took = time.monotonic() - t0
        bound = stop_bound(load)
        deadline = time.monotonic() + 20
        while (left := alive(started)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    assert rc == 0, f"SIGTERM: exit status {rc}: {tail(log)}"
    assert took <= bound, f"SIGTERM took {took:.1f} s (more than {bound:.1f} s at load {load:.1f}): {tail(log)}"
    assert not left, f"processes left behind: {sorted(left)}"
