"""Scale-out on Ray Serve, end to end: `cellserve serve --replicas 2` (a real local Ray, 2 replicas of the tiny
model, Serve's own HTTP proxy in front, our RequestRouter choosing the replica).

Everything goes over HTTP through Serve's proxy, as a client would: completions, chat, streaming, errors,
sequences with forks across many fork trees (each operation must land on the replica that holds the sequence,
checked against every replica's own `/v1/cache`, and the history must not be prefilled again: the prompt tokens
prefilled in `/metrics` grow by exactly the uncached tokens the answers report), stored responses continued on
their replica, cancel, the aggregated routes, moves and drains, and the fault case (a replica's process
SIGKILLed mid-generation: its requests end, the other replica keeps serving, Serve restarts it, its old
sequences answer 404 saying the replica is gone). Ray is started once for the module and must stop within
10 s of SIGTERM, leaving no process behind (`ray_support.serving`).
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import ray.serve  # noqa: F401  (the ray extra: make installs it; no skip)
from ray_support import serving
from tiny_models import save_tiny_model_dir

from server.ray_serve.replica import STATS_PERIOD_S
from server.ray_serve.routing import parse_id

LONG = 4000  # tokens: far more ticks than any mid-stream action needs
TREES = 20  # fork trees in the affinity test (x 20 operations each)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny-ray")
    model = str(save_tiny_model_dir(tmp / "model", seed=0, max_positions=4096))
    with serving(tmp, model, "--replicas", "2") as base:
        yield base


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120)


def replica_of(some_id: str) -> str:
    made_by = parse_id(some_id)
    assert made_by is not None, f"{some_id!r} carries no replica tag"
    return made_by


def replicas(c: httpx.Client) -> list[str]:
    health = c.get("/health")
    assert health.status_code == 200, health.text
    return sorted(health.json()["replicas"])


def prefilled(c: httpx.Client) -> float:
    """Prompt tokens prefilled, summed over the replicas (the aggregated /metrics)."""
    text = c.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("cellserve:prompt_tokens_total{"))


def test_core_routes_through_serves_proxy(url):
    with client(url) as c:
        names = replicas(c)
        assert len(names) == 2
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny-llama"

        seen = set()
        for _ in range(12):
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            # one X-Request-ID, the response's id (Serve's proxy's own is dropped), made by the replica that answered
            assert r.headers.get_list("x-request-id") == [r.json()["id"]]
            assert replica_of(r.json()["id"]) == r.headers["x-cellserve-replica"]
            seen.add(r.headers["x-cellserve-replica"])
        assert seen == set(names)  # idle replicas tie: both get requests

        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 4})
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"

        bad = c.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        assert c.get("/v1/sequences/seq-nope").status_code == 404
        gone = c.get(f"/v1/sequences/seq-rzzzzzzzz-{'0' * 32}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "replica_gone"

        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"

        metrics = c.get("/metrics").text
        assert all(f'replica="{n}"' in metrics for n in names)
        assert metrics.count("# TYPE cellserve:cells_total gauge") == 1
        cache = c.get("/v1/cache").json()
        assert cache["cells"]["total"] == sum(v["cells"]["total"] for v in cache["replicas"].values())
        cleared = c.delete("/v1/cache/prefixes").json()  # every replica clears its own cached prefixes
        assert cleared["object"] == "cache.prefixes.cleared" and set(cleared["replicas"]) == set(names)
        assert cleared["freed_cells"] == sum(cleared["replicas"].values())
        assert c.get("/v1/cache").json()["cells"]["cached"] == 0


def test_fork_trees_stay_on_their_replica_and_are_not_recomputed(url):
    """20 fork trees, every turn through the proxy: each lands on the replica holding its cells (200 there),
    and the prompt tokens prefilled grow by exactly the uncached tokens of each turn (the history is not
    prefilled again, which a turn on the wrong replica would have to do, or 404)."""
    uncached = {"n": 0, "created": 0}
    ops = {"n": 0}

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            async def op(method: str, path: str, **kw) -> dict:
                r = await c.request(method, path, **kw)
                assert r.status_code == 200, (path, r.text)
                if "/v1/sequences/" in path:
                    assert r.headers["x-cellserve-replica"] == replica_of(path.split("/")[3])
                body = r.json()
                if method == "POST" and path == "/v1/sequences":
                    uncached["created"] += body["length"]  # a new sequence prefills its prompt (if not cached)
                if "usage" in body:
                    usage = body["usage"]
                    uncached["n"] += usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
                ops["n"] += 1
                return body

            async def tree(k: int) -> list[str]:
                root = await op("POST", "/v1/sequences", json={"prompt": f"story {k}:"})
                ids = [root["id"]]
                for j in range(6):
                    parent = ids[j % len(ids)]
                    await op("POST", f"/v1/sequences/{parent}/completions",
                             json={"max_tokens": 2, "temperature": 0, "prompt": f" turn {j}"})
                    child = await op("POST", f"/v1/sequences/{parent}/fork", json={})
                    assert replica_of(child["id"]) == replica_of(parent)  # a fork stays on its parent's replica
                    ids.append(child["id"])
                    await op("GET", f"/v1/sequences/{child['id']}")
                await op("DELETE", f"/v1/sequences/{ids.pop()}")
                return ids

            trees = await asyncio.gather(*(tree(k) for k in range(TREES)))
            return [i for ids in trees for i in ids]

    with client(url) as c:
        before = prefilled(c)
    kept = asyncio.run(run())
    assert ops["n"] == TREES * 20
    with client(url) as c:
        grown = prefilled(c) - before
        cache = c.get("/v1/cache").json()
        listed = {s["id"]: s["replica"] for s in c.get("/v1/sequences").json()["data"]}
        names = replicas(c)
    assert {replica_of(i) for i in kept} == set(names)
    assert uncached["n"] > 0 and uncached["n"] <= grown <= uncached["n"] + uncached["created"], (grown, uncached)
    for name, view in cache["replicas"].items():
        assert all(replica_of(s["id"]) == name for s in view["sequences"])
    assert set(kept) <= set(listed) and all(listed[i] == replica_of(i) for i in kept)


def test_stored_responses_are_continued_on_their_replica(url):
    """A stored response is a sequence on one replica: continuing it (`previous_response_id`, in the body:
    the proxy's `RoutingHints` show it to the router), reading it and its input items go there, whichever
    replica the first turn landed on."""
    with client(url) as c:
        for k in range(6):
            first = c.post("/v1/responses", json={"input": f"story {k}:", "max_output_tokens": 2})
            assert first.status_code == 200, first.text
            rid = first.json()["id"]
            for _ in range(2):
                nxt = c.post("/v1/responses", json={"input": "go on", "previous_response_id": rid,
                                                     "max_output_tokens": 2})
                assert nxt.status_code == 200, nxt.text
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
        assert r.status_code == 200, r.text
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
    deadline = time.monotonic() + 10  # a 4,000-token generation takes far longer than this
    with client(url) as c:
        while (running := c.get("/v1/cache").json()["requests"]["running"]) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert running == 0


def prefix_hits(c: httpx.Client) -> dict[str, float]:
    """Prompt tokens served from each replica's prefix cache (the aggregated /metrics)."""
    out = {}
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("cellserve:prefix_cache_hits_total{"):
            out[line.split('replica="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_shared_prefix_goes_to_the_replica_that_cached_it(url):
    """Stateless requests through Serve's proxy whose prompts share a long prefix all land on the replica that
    served it first (by load alone each would be a coin toss): its prefix-cache hits grow, the other's do not.
    The proxy reads the prefix from the body (`RoutingHints`); the replicas report what they served."""
    shared = "You are a careful assistant who answers in the voice of a ship's log, briefly. " * 16
    with client(url) as c:
        first = c.post("/v1/completions", json={"prompt": shared + "Day 0.", "max_tokens": 2, "temperature": 0})
        assert first.status_code == 200, first.text
        holder = first.headers["x-cellserve-replica"]
        time.sleep(3 * STATS_PERIOD_S)  # the holder's next routing-stats report reaches every router
        before = prefix_hits(c)
        for k in range(1, 7):
            r = c.post("/v1/completions", json={"prompt": shared + f"Day {k}.", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200 and r.headers["x-cellserve-replica"] == holder, (k, r.text)
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        after = prefix_hits(c)
        assert set(after) == set(replicas(c))
    assert after[holder] > before.get(holder, 0)
    assert all(after[n] == before.get(n, 0) for n in after if n != holder), (holder, before, after)


def test_killed_replica_fails_fast_restarts_and_says_so(url):
    with client(url) as c:
        names = replicas(c)
        seqs: dict[str, list[str]] = {n: [] for n in names}
        while len(seqs[names[1]]) < 2 or not seqs[names[0]]:
            made = c.post("/v1/sequences", json={"prompt": "s"}).json()["id"]
            seqs[replica_of(made)].append(made)
        doomed = names[1]
        (victim, other), survivor = seqs[doomed][:2], seqs[names[0]][0]
        pid = c.get("/health").json()["replicas"][doomed]["pid"]

    results: dict = {}

    def blocking_call():  # a non-streaming request in flight on the doomed replica
        with client(url) as c3:
            try:
                results["blocking"] = c3.post(f"/v1/sequences/{other}/completions",
                                              json={"max_tokens": LONG, "ignore_eos": True})
            except httpx.HTTPError as exc:  # the connection may be cut as well: that ends it too
                results["blocking"] = exc

    t = threading.Thread(target=blocking_call)
    with client(url) as c, c.stream("POST", f"/v1/sequences/{victim}/completions", json={
            "max_tokens": LONG, "stream": True, "ignore_eos": True}) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        t.start()
        deadline = time.monotonic() + 30  # the blocking request must be running there before the kill
        while c.get("/v1/cache").json()["requests"]["running"] < 2:
            assert time.monotonic() < deadline, "the blocking request never started"
            time.sleep(0.05)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        try:
            tail = [line for line in lines if line.startswith("data: ")]
        except httpx.HTTPError:  # Serve's proxy may cut the stream rather than end it
            tail = []
        assert time.monotonic() - t0 < 30
    t.join(60)
    assert not t.is_alive()
    assert not tail or tail[-1] != "data: [DONE]" or "error" in tail[-2]  # not a normal finish
    blocking = results["blocking"]
    assert isinstance(blocking, httpx.HTTPError) or blocking.status_code >= 500, blocking.text

    with client(url) as c:
        r = c.post(f"/v1/sequences/{survivor}/completions", json={"max_tokens": 2})
        assert r.status_code == 200, r.text  # the other replica kept serving
        deadline = time.monotonic() + 120
        while (h := c.get("/health")).status_code != 200 or len(h.json()["replicas"]) != 2 \
                or doomed in h.json()["replicas"]:
            assert time.monotonic() < deadline, f"the killed replica was not replaced within 120 s: {h.text}"
            time.sleep(1.0)
        gone = c.post(f"/v1/sequences/{victim}/completions", json={"max_tokens": 2})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "replica_gone"
        assert doomed in gone.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_single_server_does_not_import_ray():
    code = "import sys, server.cli, server.app; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


GREEDY = {"temperature": 0, "max_tokens": 4}


def test_move_a_family_to_another_replica(url):
    """A parent and two continued forks move together: new ids route to the target, tokens are the same,
    the cells came along (no re-prefill) and a greedy continuation is what it would have been unmoved."""
    with client(url) as c:
        names = replicas(c)
        parent = c.post("/v1/sequences", json={"prompt": "once upon a time"}).json()["id"]
        source = replica_of(parent)
        target = next(n for n in names if n != source)
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

        assert c.post(f"/v1/sequences/{parent}/move", json={"replica": "nosuchre"}).status_code == 400
        assert c.post(f"/v1/sequences/{parent}/move", json={"replica": source}).status_code == 400  # already there
        assert c.post(f"/v1/sequences/seq-r{source}-{'0' * 32}/move", json={"replica": target}).status_code == 404
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
        elsewhere = next(n for n in names if n != replica_of(busy))
        refused = c.post(f"/v1/sequences/{busy}/move", json={"replica": elsewhere})
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
        drained = c.post(f"/v1/replicas/{name}/drain")
        assert drained.status_code == 200, drained.text
        body = drained.json()
        assert body["object"] == "replica.drained" and body["not_moved"] == {}
        assert set(body["ids"]) == set(held) >= {mine, fork}
        listed = c.get("/v1/sequences").json()["data"]
        assert not [s for s in listed if s["replica"] == name]
        assert {s["id"] for s in listed} >= set(body["ids"].values())
        assert c.post("/v1/replicas/nosuchre/drain").status_code == 400
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
