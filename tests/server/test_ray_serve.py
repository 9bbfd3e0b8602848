"""Scale-out on Ray Serve, end to end: a real local Ray instance, 2 replicas of the tiny model, one ingress.

Everything goes over HTTP through Ray Serve's proxy, as a client would: completions, chat, streaming,
errors, sequences with forks across many sequences (each operation must land on the replica that
holds the sequence, checked against every replica's own `/v1/cache`), cancel, the aggregated routes,
and the fault case (a replica's process SIGKILLed mid-generation: its in-flight requests end with a
503 or an error event, the other replica keeps serving, Ray Serve restarts it, its old sequences
answer 404 saying it restarted). Ray is started once for the module (~30 s on 2 cores) and shut down
after it (`serve.shutdown`, `ray.shutdown`); the test is skipped without the `ray` extra.
"""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from tiny_models import save_tiny_model_dir

pytest.importorskip("ray.serve")

from server.ray_serve.moves import family_of, roots
from server.ray_serve.routing import merge_metrics, parse_id, routed_id

LONG = 4000  # tokens: far more ticks than any mid-stream action needs
FAMILIES = 40  # x 26 operations each: over 1,000 sequence operations in the affinity test


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


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """`cellserve serve --replicas 2` (a local Ray, 2 CPUs, small object store) as a user runs it; on
    teardown SIGTERM must make it exit 0 and leave none of the processes it started behind."""
    tmp = tmp_path_factory.mktemp("tiny-ray")
    model = str(save_tiny_model_dir(tmp / "model", seed=0, max_positions=4096))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp / "serve.log", "w+")  # noqa: SIM115 -- closed in the fixture's finally
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model, "--port", str(port), "--n-cells", "16384",
           "--replicas", "2", "--threads-per-replica", "1", "--served-model-name", "tiny-llama",
           "--log-level", "warning", "--shutdown-grace", "1"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, f"cellserve serve --replicas exited: {tail(log)}"
            assert time.monotonic() < deadline, f"not ready within 150 s: {tail(log)}"
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield base
    finally:
        started = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own process group: only what this test started
            rc = proc.wait(10)
        deadline = time.monotonic() + 20
        while (left := started & descendants(1)) and time.monotonic() < deadline:
            time.sleep(0.5)
        log_tail = tail(log)
        log.close()
    assert rc == 0, f"SIGTERM: exit status {rc}: {log_tail}"
    assert not alive(left), f"processes left behind: {sorted(alive(left))}"


def tail(log, n: int = 3000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-n:]


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


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120)


def replica_of(some_id: str) -> str:
    parsed = parse_id(some_id)
    assert parsed is not None, f"{some_id!r} carries no replica tag"
    return f"r{parsed[0]}"


def test_core_routes_through_the_ingress(url):
    with client(url) as c:
        health = c.get("/health")
        assert health.status_code == 200 and set(health.json()["replicas"]) == {"r0", "r1"}
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny-llama"

        seen = set()
        for _ in range(4):
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.headers["x-cellserve-route"] == "least-loaded"
            assert r.headers["x-request-id"] == r.json()["id"] and replica_of(r.json()["id"]) == \
                r.headers["x-cellserve-replica"]
            seen.add(r.headers["x-cellserve-replica"])
        assert seen == {"r0", "r1"}  # idle replicas tie: the rotation spreads them

        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 4})
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"

        bad = c.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        assert c.get("/v1/sequences/seq-nope").status_code == 404

        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"

        metrics = c.get("/metrics").text
        assert 'replica="r0"' in metrics and 'replica="r1"' in metrics
        assert metrics.count("# TYPE cellserve:cells_total gauge") == 1
        cache = c.get("/v1/cache").json()
        assert cache["cells"]["total"] == sum(v["cells"]["total"] for v in cache["replicas"].values())
        cleared = c.delete("/v1/cache/prefixes").json()  # every replica clears its own cached prefixes
        assert cleared["object"] == "cache.prefixes.cleared" and set(cleared["replicas"]) == {"r0", "r1"}
        assert cleared["freed_cells"] == sum(cleared["replicas"].values())
        assert c.get("/v1/cache").json()["cells"]["cached"] == 0


def test_sequence_operations_never_cross_replicas(url):
    """Many sequences, forks of forks, continuations, truncates and deletes: each lands where its id says."""
    ops = {"n": 0}

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            async def op(method: str, path: str, **kw) -> dict:
                r = await c.request(method, path, **kw)
                assert r.status_code == 200, (path, r.text)
                if "/v1/sequences/" in path:
                    assert r.headers["x-cellserve-route"] == "affinity"
                    assert r.headers["x-cellserve-replica"] == replica_of(path.split("/")[3])
                ops["n"] += 1
                return r.json()

            async def family(k: int) -> list[str]:
                root = await op("POST", "/v1/sequences", json={"prompt": f"story {k}:"})
                ids = [root["id"]]
                for j in range(6):
                    parent = ids[j % len(ids)]
                    await op("POST", f"/v1/sequences/{parent}/completions", json={"max_tokens": 2, "temperature": 0})
                    child = await op("POST", f"/v1/sequences/{parent}/fork", json={})
                    assert replica_of(child["id"]) == replica_of(parent)  # a fork stays on its parent's replica
                    ids.append(child["id"])
                    await op("POST", f"/v1/sequences/{child['id']}/truncate", json={"length": 2})
                    await op("GET", f"/v1/sequences/{child['id']}")
                await op("DELETE", f"/v1/sequences/{ids.pop()}")
                return ids

            families = await asyncio.gather(*(family(k) for k in range(FAMILIES)))
            return [i for ids in families for i in ids]

    kept = asyncio.run(run())
    assert ops["n"] >= 1000
    assert {replica_of(i) for i in kept} == {"r0", "r1"}
    with client(url) as c:
        cache = c.get("/v1/cache").json()
        listed = {s["id"]: s["replica"] for s in c.get("/v1/sequences").json()["data"]}
    for name, view in cache["replicas"].items():
        assert all(replica_of(s["id"]) == name for s in view["sequences"])
    assert set(kept) <= set(listed) and all(listed[i] == replica_of(i) for i in kept)


def test_stored_responses_are_continued_on_their_replica(url):
    """A stored response is a sequence on one replica: continuing it (`previous_response_id`), reading it
    and its input items go there, whichever replica the first turn landed on."""
    with client(url) as c:
        for k in range(4):  # least-loaded spreads the first turns over both replicas
            first = c.post("/v1/responses", json={"input": f"story {k}:", "max_output_tokens": 2})
            assert first.status_code == 200, first.text
            rid = first.json()["id"]
            for _ in range(2):
                nxt = c.post("/v1/responses", json={"input": "go on", "previous_response_id": rid,
                                                     "max_output_tokens": 2})
                assert nxt.status_code == 200, nxt.text
                assert nxt.headers["x-cellserve-route"] == "affinity"
                assert nxt.headers["x-cellserve-replica"] == replica_of(rid)
                assert nxt.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
                rid = nxt.json()["id"]
            for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items"):
                r = c.get(path)
                assert r.status_code == 200 and r.headers["x-cellserve-replica"] == replica_of(rid), r.text


def test_cancel_goes_to_the_replica_running_the_request(url):
    with client(url) as c, c.stream("POST", "/v1/completions", json={
            "prompt": "a", "max_tokens": LONG, "stream": True, "ignore_eos": True}) as s:
        rid = s.headers["x-request-id"]
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        with client(url) as c2:
            r = c2.post(f"/v1/requests/{rid}/cancel")
        assert r.status_code == 200 and r.headers["x-cellserve-route"] == "affinity", r.text
        assert r.headers["x-cellserve-replica"] == replica_of(rid)
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "cancelled"


def test_client_going_away_cancels_on_the_replica(url):
    """A client that hangs up (streaming or not) frees the replica's work, as with the single server."""
    body = {"prompt": "a", "max_tokens": LONG, "ignore_eos": True}
    with client(url) as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        next(line for line in s.iter_lines() if line.startswith("data: "))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 5  # a 4,000-token generation takes far longer than this
    with client(url) as c:
        while (running := c.get("/v1/cache").json()["requests"]["running"]) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert running == 0


def test_killed_replica_fails_fast_restarts_and_says_so(url):
    with client(url) as c:
        seqs: dict[str, list[str]] = {"r0": [], "r1": []}
        while len(seqs["r1"]) < 2 or not seqs["r0"]:
            made = c.post("/v1/sequences", json={"prompt": "s"}).json()["id"]
            seqs[replica_of(made)].append(made)
        (victim, other), survivor = seqs["r1"][:2], seqs["r0"][0]
        pid = c.get("/health").json()["replicas"]["r1"]["pid"]

    results: dict = {}

    def blocking_call():  # a non-streaming request in flight on r1
        with client(url) as c3:
            results["blocking"] = c3.post(f"/v1/sequences/{other}/completions",
                                          json={"max_tokens": LONG, "ignore_eos": True})

    t = threading.Thread(target=blocking_call)
    with client(url) as c, c.stream("POST", f"/v1/sequences/{victim}/completions", json={
            "max_tokens": LONG, "stream": True, "ignore_eos": True}) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        t.start()
        deadline = time.monotonic() + 30  # the blocking request must be running on r1 before the kill (on a
        while c.get("/v1/cache").json()["requests"]["running"] < 2:  # loaded machine 0.5 s was not always enough)
            assert time.monotonic() < deadline, "the blocking request never started"
            time.sleep(0.05)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        tail = [line for line in lines if line.startswith("data: ")]
        assert time.monotonic() - t0 < 30
    t.join(60)
    assert tail[-1] == "data: [DONE]"
    err = json.loads(tail[-2][6:])["error"]
    assert err["code"] == "replica_unavailable" and "r1" in err["message"]
    assert results["blocking"].status_code == 503 and "retry-after" in results["blocking"].headers, \
        results["blocking"].text
    assert "r1" in results["blocking"].json()["error"]["message"]

    with client(url) as c:
        r = c.post(f"/v1/sequences/{survivor}/completions", json={"max_tokens": 2})
        assert r.status_code == 200, r.text  # the other replica kept serving
        deadline = time.monotonic() + 90
        while (h := c.get("/health")).status_code != 200 or h.json()["replicas"]["r1"]["pid"] == pid:
            if h.status_code != 200:
                assert "r1" in h.json()["error"]["message"] and "r0" not in h.json()["error"]["message"]
            assert time.monotonic() < deadline, "replica r1 was not restarted within 90 s"
            time.sleep(0.5)
        gone = c.post(f"/v1/sequences/{victim}/completions", json={"max_tokens": 2})
        assert gone.status_code == 404 and "restarted" in gone.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_prefix_routing_follows_the_cached_prompt(url):
    """A repeated long system prompt goes back to the replica that cached it, and hits its prefix cache."""
    system = "You are a terse assistant who answers in one line. " * 8
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}], "max_tokens": 2}
    with client(url) as c:
        first = c.post("/v1/chat/completions", json=body)
        again = [c.post("/v1/chat/completions", json=body) for _ in range(3)]
    assert first.status_code == 200
    for r in again:
        assert r.headers["x-cellserve-route"] == "prefix", r.headers
        assert r.headers["x-cellserve-replica"] == first.headers["x-cellserve-replica"]
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_single_server_does_not_import_ray():
    code = "import sys, server.cli, server.app; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_routing_helpers():
    assert routed_id("/v1/sequences/seq-x/fork") == "seq-x" and routed_id("/v1/requests/cmpl-y/cancel") == "cmpl-y"
    assert routed_id("/v1/sequences") is None and parse_id("seq-" + "a" * 32) is None
    assert routed_id("/v1/responses/resp-r1-x/input_items") == "resp-r1-x"
    assert routed_id("/v1/responses", b'{"input": "hi", "previous_response_id": "resp-r2-y"}') == "resp-r2-y"
    assert routed_id("/v1/responses", b'{"input": "hi"}') is None
    assert routed_id("/v1/responses", b'{"previous_response_id": 5}') is None
    assert routed_id("/v1/responses", b'[not json "previous_response_id"') is None
    assert parse_id("seq-r12-0badf00d-" + "a" * 32) == (12, "0badf00d")
    text = {"r0": '# HELP x_total X.\n# TYPE x_total counter\nx_total{k="a"} 1.0\n# TYPE y gauge\ny 2.0\n',
            "r1": '# HELP x_total X.\n# TYPE x_total counter\nx_total{k="a"} 3.0\n# TYPE y gauge\ny 4.0\n'}
    assert merge_metrics(text).splitlines() == [
        "# HELP x_total X.", "# TYPE x_total counter", 'x_total{replica="r0",k="a"} 1.0',
        'x_total{replica="r1",k="a"} 3.0', "# TYPE y gauge", 'y{replica="r0"} 2.0', 'y{replica="r1"} 4.0']


GREEDY = {"temperature": 0, "max_tokens": 4}


def other_than(name: str) -> str:
    return "r1" if name == "r0" else "r0"


def test_move_a_family_to_another_replica(url):
    """A parent and two continued forks move together: new ids route to the target, tokens are the same,
    the cells came along (no re-prefill) and a greedy continuation is what it would have been unmoved."""
    with client(url) as c:
        parent = c.post("/v1/sequences", json={"prompt": "once upon a time"}).json()["id"]
        source = replica_of(parent)
        target = other_than(source)  # creates go least-loaded: move to whichever replica it is not on
        c.post(f"/v1/sequences/{parent}/completions", json=GREEDY).raise_for_status()
        forks = [c.post(f"/v1/sequences/{parent}/fork", json={}).json()["id"] for _ in range(2)]
        for k, fork in enumerate(forks):
            c.post(f"/v1/sequences/{fork}/completions", json={**GREEDY, "prompt": f" and {k}"}).raise_for_status()
        family = [parent, *forks]
        before = {s: c.get(f"/v1/sequences/{s}").json()["token_ids"] for s in family}
        probe = c.post(f"/v1/sequences/{forks[1]}/fork", json={}).json()["id"]  # the unmoved oracle
        oracle = c.post(f"/v1/sequences/{probe}/completions", json=GREEDY).json()
        expected = oracle["choices"][0]["text"]
        c.delete(f"/v1/sequences/{probe}").raise_for_status()

        assert c.post(f"/v1/sequences/{parent}/move", json={"replica": "r9"}).status_code == 400
        assert c.post(f"/v1/sequences/{parent}/move", json={"replica": source}).status_code == 400  # already there
        assert c.post(f"/v1/sequences/seq-{source}-00000000-{'0' * 32}/move", json={"replica": target}).status_code == 404
        moved = c.post(f"/v1/sequences/{forks[0]}/move", json={"replica": target})
        assert moved.status_code == 200, moved.text
        body = moved.json()
        assert body["object"] == "sequence.moved" and body["replica"] == target and set(body["ids"]) == set(family)
        for old, new in body["ids"].items():
            assert c.get(f"/v1/sequences/{old}").status_code == 404
            got = c.get(f"/v1/sequences/{new}")
            assert got.headers["x-cellserve-replica"] == target and replica_of(new) == target
            view = got.json()
            assert view["token_ids"] == before[old]
            # the cells came along: the whole history is cached before anything ran there (no re-prefill)
            assert view["cells"]["cached_tokens"] == len(before[old]) - 1
        assert c.get(f"/v1/sequences/{body['ids'][forks[0]]}").json()["parent"] == body["ids"][parent]
        branch = body["ids"][forks[1]]
        after = c.post(f"/v1/sequences/{branch}/completions", json=GREEDY).json()
        assert after["choices"][0]["text"] == expected
        assert after["usage"] == oracle["usage"]

        busy = c.post("/v1/sequences", json={"prompt": "busy"}).json()["id"]
        run = threading.Thread(target=lambda: client(url).post(
            f"/v1/sequences/{busy}/completions", json={"max_tokens": LONG, "ignore_eos": True}))
        run.start()
        deadline = time.monotonic() + 30
        while c.get(f"/v1/sequences/{busy}").json()["status"] == "idle" and time.monotonic() < deadline:
            time.sleep(0.05)
        refused = c.post(f"/v1/sequences/{busy}/move", json={"replica": other_than(replica_of(busy))})
        assert refused.status_code == 409 and "generating" in refused.json()["error"]["message"]
        assert c.get(f"/v1/sequences/{busy}").status_code == 200
        c.delete(f"/v1/sequences/{busy}")  # cancels the generation
        run.join(30)


def test_drain_moves_every_family_off_a_replica(url):
    with client(url) as c:
        mine = c.post("/v1/sequences", json={"prompt": "drain me"}).json()["id"]
        fork = c.post(f"/v1/sequences/{mine}/fork", json={}).json()["id"]
        name = replica_of(mine)
        held = [s["id"] for s in c.get("/v1/sequences").json()["data"] if s["replica"] == name]
        started = time.monotonic()
        drained = c.post(f"/v1/replicas/{name}/drain")
        took = time.monotonic() - started
        assert drained.status_code == 200, drained.text
        body = drained.json()
        assert body["object"] == "replica.drained" and body["not_moved"] == {}
        assert set(body["ids"]) == set(held) >= {mine, fork}, (len(held), took)
        listed = c.get("/v1/sequences").json()["data"]
        assert not [s for s in listed if s["replica"] == name]
        assert {s["id"] for s in listed} >= set(body["ids"].values())
        assert c.post("/v1/replicas/r7/drain").status_code == 400
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_move_helpers():
    listed = [{"id": "a", "parent": None, "created": 1}, {"id": "b", "parent": "a", "created": 2},
              {"id": "c", "parent": "b", "created": 3}, {"id": "d", "parent": None, "created": 0}]
    assert {s["id"] for s in family_of("c", listed)} == {"a", "b", "c"}
    assert roots(listed) == ["d", "a"]
