"""`cellserve serve --replicas 2 --state-dir DIR`: each replica keeps its sequences in a slot folder of its own
(`DIR/replica-K`, `server.ray_serve.state_slots`). A replica's process `kill -9`ed: Serve starts another, which
takes the dead one's slot and brings its sequences back under their old ids (the same tokens; it answers for
them, 200, and continues them), where without `--state-dir` they answer 404 (test_ray_serve). Then the whole
deployment is stopped (SIGTERM, within 10 s) and started again on the same folder: every sequence answers again.
"""

import os
import signal
import time

import httpx
import ray.serve  # noqa: F401  (the ray extra: make installs it; no skip)
from ray_support import serving
from tiny_models import save_tiny_model_dir

from server.ray_serve.routing import parse_id

BACK_S = 240.0  # Serve notices the death, starts a replica, which loads the model, on 2 loaded cores


def views(c: httpx.Client, sids: list[str], wait_s: float = 0.0) -> dict[str, list[int]]:
    """Each sequence's tokens; waiting up to `wait_s` for each to answer (routers learn restored ids from the
    replicas' next routing-stats report)."""
    out = {}
    deadline = time.monotonic() + wait_s
    for sid in sids:
        while (r := c.get(f"/v1/sequences/{sid}")).status_code != 200 and time.monotonic() < deadline:
            time.sleep(1)
        assert r.status_code == 200, (sid, r.text)
        out[sid] = r.json()["token_ids"]
    return out


def test_a_dead_replicas_sequences_come_back_from_the_state_dir(tmp_path):
    model = str(save_tiny_model_dir(tmp_path / "model", seed=0, max_positions=4096))
    state = tmp_path / "state"
    flags = ("--replicas", "2", "--state-dir", str(state))
    with serving(tmp_path, model, *flags) as url, httpx.Client(base_url=url, timeout=120) as c:
        on: dict[str, list[str]] = {}
        while len(on) < 2 or min(len(v) for v in on.values()) < 2:
            made = c.post("/v1/sequences", json={"prompt": f"kept {sum(map(len, on.values()))}:"})
            assert made.status_code == 200, made.text
            sid = made.json()["id"]
            grown = c.post(f"/v1/sequences/{sid}/completions", json={"max_tokens": 3, "temperature": 0})
            assert grown.status_code == 200, grown.text
            on.setdefault(parse_id(sid), []).append(sid)
            fork = c.post(f"/v1/sequences/{sid}/fork", json={})
            assert fork.status_code == 200, fork.text
            on[parse_id(sid)].append(fork.json()["id"])
        every = [sid for sids in on.values() for sid in sids]
        history = views(c, every)
        assert sorted(p.name for p in state.iterdir() if p.is_dir()) == ["replica-0", "replica-1"]
        health = c.get("/health").json()["replicas"]
        doomed = min(on)
        os.kill(health[doomed]["pid"], signal.SIGKILL)

        deadline = time.monotonic() + BACK_S
        while True:  # Serve's new replica restores the dead one's slot; the router learns it holds those ids
            r = c.get(f"/v1/sequences/{on[doomed][0]}")
            if r.status_code == 200 and r.headers["x-cellserve-replica"] != doomed:
                break
            assert r.status_code in (404, 500, 502, 503), r.text
            assert time.monotonic() < deadline, f"not back within {BACK_S} s: {r.text}"
            time.sleep(2)
        heir = r.headers["x-cellserve-replica"]
        assert heir not in on and heir in c.get("/health").json()["replicas"]
        assert views(c, every, wait_s=10) == history
        for sid in on[doomed]:
            cont = c.post(f"/v1/sequences/{sid}/completions", json={"max_tokens": 2, "temperature": 0})
            assert cont.status_code == 200 and cont.headers["x-cellserve-replica"] == heir, cont.text
            history[sid] = c.get(f"/v1/sequences/{sid}").json()["token_ids"]

    with serving(tmp_path, model, *flags) as url, httpx.Client(base_url=url, timeout=120) as c:
        assert views(c, every, wait_s=30) == history
