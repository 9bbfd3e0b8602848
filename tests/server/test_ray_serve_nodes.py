"""Two Ray nodes on one machine: `ray start --head --num-cpus 1` and `ray start --address ... --num-cpus 1` (its own
raylet), `cellserve serve --ray-address ... --replicas 2` joining them: one replica per node (one CPU each), Serve's
proxy on both nodes (the same port, SO_REUSEPORT). Then `kill -9` of the second node's raylet: that node's
replica goes, the other node keeps serving, the lost replica's sequences answer a clear 404.

Each `ray start --block` runs in its own process group, stopped (SIGTERM, then SIGKILL of the group) even when
the test fails: only the processes this test started. `cellserve serve` joined, so on SIGTERM it deletes only
its application and must exit within 10 s (`ray_support.serving`).
"""

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import ray.serve  # noqa: F401  (the ray extra: make installs it; no skip)
from ray_support import descendants, free_port, serving, tail
from tiny_models import save_tiny_model_dir

from server.ray_serve.routing import parse_id

RAY = str(Path(sys.executable).with_name("ray"))
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # as a multi-host cluster runs
NODE_S = 180.0


@contextmanager
def ray_node(log: Path, *flags: str):
    """`ray start --block FLAGS` in its own process group; stopped with its whole group on exit."""
    env = {**os.environ, **AUTH, "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "server.ray_serve.proxy_headers.middlewares"}
    with open(log, "w") as out:
        proc = subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", *flags], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        yield proc
    finally:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(wait)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        stragglers = descendants(proc.pid)
        for pid in stragglers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def started(log: Path, node: subprocess.Popen) -> bool:
    assert node.poll() is None, f"ray start exited {node.returncode}: {tail(log)}"
    return "Ray runtime started" in tail(log, 100_000)


def raylet_of(node: subprocess.Popen) -> int:
    for pid in descendants(node.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"/raylet" in f.read().split(b"\0")[0]:
                    return pid
        except OSError:
            pass
    raise AssertionError("the second node has no raylet process")


def test_two_nodes_then_a_dead_raylet(tmp_path):
    model = str(save_tiny_model_dir(tmp_path / "model", seed=0, max_positions=4096))
    gcs = free_port()
    with ExitStack() as stack:
        head = stack.enter_context(ray_node(tmp_path / "head.log", "--head", "--port", str(gcs), "--num-cpus", "1",
                                            "--include-dashboard=false"))
        deadline = time.monotonic() + NODE_S
        while not started(tmp_path / "head.log", head):
            assert time.monotonic() < deadline, tail(tmp_path / "head.log")
            time.sleep(1)
        address = re.search(r"ray start --address='([^']+)'", tail(tmp_path / "head.log", 100_000)).group(1)
        worker = stack.enter_context(ray_node(tmp_path / "worker.log", "--address", address,
                                              "--num-cpus", "1"))
        while not started(tmp_path / "worker.log", worker):
            assert time.monotonic() < deadline, tail(tmp_path / "worker.log")
            time.sleep(1)
        url = stack.enter_context(serving(tmp_path, model, "--replicas", "2", "--ray-address", address,
                                           env=AUTH))
        with httpx.Client(base_url=url, timeout=120) as c:
            view = c.get("/health").json()["replicas"]
            assert len({v["node"] for v in view.values()}) == 2  # one replica on each node
            on: dict[str, list[str]] = {uid: [] for uid in view}
            while not all(on.values()):
                made = c.post("/v1/sequences", json={"prompt": "two nodes"})
                assert made.status_code == 200, made.text
                on[parse_id(made.json()["id"])].append(made.json()["id"])
            raylet = raylet_of(worker)
            doomed = next(uid for uid, v in view.items() if v["pid"] in descendants(worker.pid))
            kept = next(uid for uid in view if uid != doomed)

            os.kill(raylet, signal.SIGKILL)
        # new connections from here on: a pooled one may be the dead node's proxy's
        deadline = time.monotonic() + 120
        while True:  # the lost replica's sequences: a clear 404 once Serve has dropped it
            try:
                r = httpx.get(f"{url}/v1/sequences/{on[doomed][0]}", timeout=60)
            except httpx.TransportError:  # the dead node's proxy took the connection
                r = None
            if r is not None and r.status_code == 404:
                break
            assert r is None or r.status_code in (200, 500, 502, 503), r.text
            assert time.monotonic() < deadline, f"no 404 within 120 s: {r and r.text}"
            time.sleep(2)
        assert r.json()["error"]["code"] == "replica_gone" and doomed in r.json()["error"]["message"]
        with httpx.Client(base_url=url, timeout=120) as c:
            for sid in on[kept]:  # the other node keeps serving its sequences and new requests
                cont = c.post(f"/v1/sequences/{sid}/completions", json={"max_tokens": 2})
                assert cont.status_code == 200 and cont.headers["x-cellserve-replica"] == kept, cont.text
            fresh = c.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
            assert fresh.status_code == 200 and fresh.headers["x-cellserve-replica"] == kept
