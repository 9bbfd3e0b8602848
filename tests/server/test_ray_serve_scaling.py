"""Serve's autoscaling of the engine deployment: `cellserve serve --replicas auto:1-3`, from 1 replica to 3 under
load and back to 1, with every sequence still answering with its history.

Load (concurrent streaming generations) makes Serve add replicas, which take new stateless requests at once;
sequences are made while there are 3, so some live on replicas that Serve then removes; before one is removed,
its fork families move to the replica that stays (with their cells, keeping their ids). Afterwards every
sequence, wherever it was made, answers with its exact tokens and continues (200) without its history being
prefilled again. The deployment must stop within 10 s of SIGTERM (`ray_support.serving`).
"""

import threading
import time

import httpx
import ray.serve  # noqa: F401  (the ray extra: make installs it; no skip)
from ray_support import serving
from tiny_models import save_tiny_model_dir

from server.ray_serve.routing import parse_id

SCALE_S = 240.0  # new replicas start on 2 loaded cores


def count(c: httpx.Client) -> int:
    h = c.get("/health")
    return len(h.json()["replicas"]) if h.status_code == 200 else -1


def test_autoscale_one_to_three_and_back_keeps_every_sequence(tmp_path):
    model = str(save_tiny_model_dir(tmp_path / "model", seed=0, max_positions=4096))
    flags = ("--replicas", "auto:1-3", "--target-ongoing-requests", "1", "--downscale-delay", "5")
    with serving(tmp_path, model, *flags, replicas=1) as url, httpx.Client(base_url=url, timeout=120) as c:
        families = [c.post("/v1/sequences", json={"prompt": f"before {k}:"}).json()["id"] for k in range(3)]
        assert len({parse_id(s) for s in families}) == 1

        stop = threading.Event()

        def load() -> None:  # keeps 6 generations in flight until told to stop
            with httpx.Client(base_url=url, timeout=120) as lc:
                while not stop.is_set():
                    lc.post("/v1/completions", json={"prompt": "load", "max_tokens": 64, "ignore_eos": True})

        workers = [threading.Thread(target=load) for _ in range(6)]
        for w in workers:
            w.start()
        try:
            deadline = time.monotonic() + SCALE_S
            while count(c) != 3:
                assert time.monotonic() < deadline, f"not scaled up to 3 within {SCALE_S} s: {c.get('/health').text}"
                time.sleep(2)
            names = set(c.get("/health").json()["replicas"])
            answered = set()
            for k in range(12):  # new stateless traffic reaches the new replicas, and sequences land on them
                made = c.post("/v1/sequences", json={"prompt": f"during {k}:"})
                assert made.status_code == 200, made.text
                families.append(made.json()["id"])
                answered.add(made.headers["x-cellserve-replica"])
            assert len(answered) >= 2 and answered <= names
        finally:
            stop.set()
            for w in workers:
                w.join(120)

        for sid in list(families):  # a fork of each, so families (not only single sequences) move
            fork = c.post(f"/v1/sequences/{sid}/fork", json={})
            assert fork.status_code == 200, fork.text
            families.append(fork.json()["id"])
        views = {sid: c.get(f"/v1/sequences/{sid}").json() for sid in families}
        history = {sid: v["token_ids"] for sid, v in views.items()}
        cached = {sid: v["cells"]["cached_tokens"] for sid, v in views.items()}
        made_on = {parse_id(sid) for sid in families}
        assert len(made_on) >= 2

        deadline = time.monotonic() + SCALE_S
        while count(c) != 1:
            assert time.monotonic() < deadline, f"not scaled down to 1 within {SCALE_S} s: {c.get('/health').text}"
            time.sleep(2)
        (left,) = c.get("/health").json()["replicas"]
        assert made_on - {left}, "every sequence was on the replica that stayed: nothing was tested"
        assert sum(n for sid, n in cached.items() if parse_id(sid) != left) > 0  # moved sequences had cells
        lost_cells = {}
        for sid, tokens in history.items():
            got = c.get(f"/v1/sequences/{sid}")
            assert got.status_code == 200, (sid, got.text)
            assert got.json()["token_ids"] == tokens and got.headers["x-cellserve-replica"] == left
            if got.json()["cells"]["cached_tokens"] != cached[sid]:  # its cells came along
                lost_cells[sid] = (cached[sid], got.json()["cells"], views[sid]["parent"])
        assert not lost_cells, (left, lost_cells, cached)
        more = c.post(f"/v1/sequences/{families[-1]}/completions", json={"max_tokens": 2, "temperature": 0})
        assert more.status_code == 200, more.text
        assert more.json()["usage"]["prompt_tokens"] == 0  # nothing of its history prefilled again
