"""Durable sequences over HTTP (`--state-dir`): a server restarted on the same folder lists and continues
every sequence; save / export / import verbs; and `cellserve serve` killed with SIGKILL in the middle of a
burst of writes keeps every sequence it acknowledged, with identical tokens."""

import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
from http_support import LiveServer
from test_http_cli import ROOT, free_port, wait_healthy

PROMPT = [(7 * i) % 90 + 5 for i in range(100)]
GREEDY = {"temperature": 0, "ignore_eos": True}
BURST_OPS = 12  # acknowledged writes before each kill


def _family(c: httpx.Client) -> dict[str, str]:
    root = c.post("/v1/sequences", json={"prompt": PROMPT}).raise_for_status().json()["id"]
    ids = {"root": root, "whole": c.post(f"/v1/sequences/{root}/fork").json()["id"],
           "mid": c.post(f"/v1/sequences/{root}/fork", json={"at": 50}).json()["id"]}
    c.post(f"/v1/sequences/{ids['whole']}/completions", json={"prompt": [4, 5], "max_tokens": 8, **GREEDY})
    c.post(f"/v1/sequences/{ids['mid']}/truncate", json={"length": 40}).raise_for_status()
    return ids


def _tokens(c: httpx.Client, seq_id: str) -> list[int]:
    return c.get(f"/v1/sequences/{seq_id}").raise_for_status().json()["token_ids"]


def test_restart_save_export_import(model_dir, long_model_dir, tmp_path):
    with LiveServer(model_dir, state_dir=tmp_path / "state", n_cells=1024) as srv, srv.client() as c:
        ids = _family(c)
        before = {k: _tokens(c, v) for k, v in ids.items()}
        saved = c.post(f"/v1/sequences/{ids['whole']}/save")
        assert saved.status_code == 200 and saved.json()["saved"] is True
        assert c.post("/v1/sequences/seq-0000/save").status_code == 404
        archive = c.get(f"/v1/sequences/{ids['mid']}/export", params={"family": "true"})
        assert archive.status_code == 200 and archive.headers["content-type"] == "application/octet-stream"
        expected = c.post(f"/v1/sequences/{ids['whole']}/completions",
                          json={"max_tokens": 6, **GREEDY}).json()["choices"][0]["text"]
        c.post(f"/v1/sequences/{ids['whole']}/truncate", json={"length": len(before["whole"])}).raise_for_status()

    with LiveServer(model_dir, state_dir=tmp_path / "state", n_cells=1024) as srv, srv.client() as c:
        listed = {s["id"]: s for s in c.get("/v1/sequences").json()["data"]}
        assert set(listed) == set(ids.values())
        for name, seq_id in ids.items():
            assert _tokens(c, seq_id) == before[name]
            cells = listed[seq_id]["cells"]  # lazy: in the state dir, loaded when it runs (not re-prefilled)
            assert (cells["cached_tokens"], cells["saved_tokens"]) == (0, len(before[name]) - 1)
        plain = c.post("/v1/completions", json={"prompt": before["whole"], "max_tokens": 1, **GREEDY}).json()
        assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == len(before["whole"]) - 1
        again = c.post(f"/v1/sequences/{ids['whole']}/completions", json={"max_tokens": 6, **GREEDY}).json()
        assert again["choices"][0]["text"] == expected
        imported = c.post("/v1/sequences/import", content=archive.content).raise_for_status().json()["data"]
        assert len(imported) == len(ids) and not {s["id"] for s in imported} & set(ids.values())  # ids taken here

    with LiveServer(model_dir, n_cells=1024) as srv, srv.client() as c:  # no state dir: import still works
        imported = c.post("/v1/sequences/import", content=archive.content).json()["data"]
        assert {s["id"] for s in imported} == set(ids.values())  # free here: the same ids
        assert c.post(f"/v1/sequences/{ids['root']}/save").status_code == 400  # nowhere to save to
        assert c.post("/v1/sequences/import", content=b"not an archive").status_code == 409
        for seq_id in ids.values():  # free again, yet ?new_ids=true mints ids here (a scale-out move)
            c.delete(f"/v1/sequences/{seq_id}")
        fresh = c.post("/v1/sequences/import?new_ids=true", content=archive.content).json()["ids"]
        assert set(fresh) == set(ids.values()) and not set(fresh.values()) & set(ids.values())  # minted here
    with LiveServer(long_model_dir, n_cells=1024) as srv, srv.client() as c:  # another model (its config differs)
        refused = c.post("/v1/sequences/import", content=archive.content)
        assert refused.status_code == 409 and "another model" in refused.json()["error"]["message"]


class Burst:
    """Writes to sequences one at a time until the server dies, keeping what it acknowledged: for each
    sequence a known token prefix and its exact length; the write in flight may or may not have landed."""

    def __init__(self, url: str, known: dict[str, tuple[list[int], int]], rng: random.Random):
        self.url, self.known, self.rng = url, known, rng
        self.inflight: tuple[str, tuple[list[int], int] | None] | None = None  # (id, its state if it lands)
        self.acked = 0

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=30) as c:
                while True:
                    self.step(c)
                    self.acked += 1
        except (httpx.TransportError, httpx.HTTPStatusError):
            return  # the server was killed

    def step(self, c: httpx.Client) -> None:
        op = self.rng.choice(["create", "fork", "continue", "continue", "truncate", "delete"] if self.known else ["create"])
        if op == "create":
            prompt = [self.rng.randrange(3, 90) for _ in range(self.rng.randrange(5, 80))]
            seq_id = c.post("/v1/sequences", json={"prompt": prompt}).raise_for_status().json()["id"]
            self.known[seq_id] = (prompt, len(prompt))
            return
        seq_id = self.rng.choice(sorted(self.known))
        prefix, length = self.known[seq_id]
        if op == "fork":
            at = self.rng.randrange(1, len(prefix) + 1)
            child = c.post(f"/v1/sequences/{seq_id}/fork", json={"at": at}).raise_for_status().json()["id"]
            self.known[child] = (prefix[:at], at)
            return
        if op == "continue":
            extra = [self.rng.randrange(3, 90) for _ in range(self.rng.randrange(0, 4))]
            after = (prefix + extra if len(prefix) == length else prefix, length + len(extra) + 4)
            self.inflight = (seq_id, after)
            c.post(f"/v1/sequences/{seq_id}/completions",
                   json={"prompt": extra, "max_tokens": 4, **GREEDY}).raise_for_status()
        elif op == "truncate":
            cut = self.rng.randrange(1, len(prefix) + 1)
            self.inflight = (seq_id, (prefix[:cut], cut))
            c.post(f"/v1/sequences/{seq_id}/truncate", json={"length": cut}).raise_for_status()
        else:
            if len(self.known) < 3:
                return
            self.inflight = (seq_id, None)
            c.delete(f"/v1/sequences/{seq_id}").raise_for_status()
        after = self.inflight[1]
        self.inflight = None
        if after is None:
            del self.known[seq_id]
        else:
            self.known[seq_id] = after


def _check(c: httpx.Client, burst: Burst) -> None:
    """Every acknowledged sequence is there with its tokens; the write in flight left the old or the new state."""
    on_disk = {s["id"] for s in c.get("/v1/sequences").raise_for_status().json()["data"]}
    inflight = burst.inflight or (None, None)
    for seq_id, state in list(burst.known.items()):
        states = [state] + ([inflight[1]] if inflight[0] == seq_id else [])
        if seq_id == inflight[0] and inflight[1] is None and seq_id not in on_disk:
            del burst.known[seq_id]  # the delete in flight landed
            continue
        assert seq_id in on_disk, f"acknowledged sequence {seq_id} is lost"
        tokens = _tokens(c, seq_id)
        assert any(s is None or (tokens[: len(s[0])] == s[0] and len(tokens) == s[1]) for s in states), seq_id
        burst.known[seq_id] = (tokens, len(tokens))  # exact from here on
    burst.inflight = None


def test_sigkill_in_a_burst_of_writes_keeps_every_acknowledged_sequence(model_dir, tmp_path):
    rng = random.Random(28)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model_dir, "--port", str(port), "--n-cells", "2048",
           "--threads", "1", "--state-dir", str(tmp_path / "state"), "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    burst = Burst(url, {}, rng)
    for kill_after in [rng.uniform(0.0, 0.4) for _ in range(2)] + [None]:  # 2 kills at random points
        with open(tmp_path / "log", "a") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_healthy(url, proc)
            with httpx.Client(base_url=url, timeout=30) as c:
                _check(c, burst)
            if kill_after is None:
                break
            writer = threading.Thread(target=burst.run)
            acked, writer_started = burst.acked, time.monotonic()
            writer.start()
            while burst.acked < acked + BURST_OPS and writer.is_alive() and time.monotonic() - writer_started < 30:
                time.sleep(0.01)
            time.sleep(kill_after)  # then kill it at a random point of the writes that follow
            proc.send_signal(signal.SIGKILL)
            writer.join(30)
            assert not writer.is_alive()
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert burst.known  # the bursts did write
