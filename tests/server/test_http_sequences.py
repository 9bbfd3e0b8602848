"""Stateful sequences over HTTP: fork a conversation, continue branches, truncate, delete, busy rules."""

import threading

import httpx
import pytest
from http_support import LONG_TOKENS, Greedy, LiveServer, sse_events

TRUNK = "ROMEO: But soft, what light through yonder window breaks?"


@pytest.fixture(scope="module")
def srv(long_model_dir):
    with LiveServer(long_model_dir, n_cells=8192) as server:
        yield server


@pytest.fixture(scope="module")
def greedy(long_model_dir):
    return Greedy(long_model_dir)


@pytest.fixture
def c(srv):
    with srv.client() as client:
        yield client
    for s in srv.cache()["sequences"]:  # every test starts from an empty pool
        httpx.delete(f"{srv.url}/v1/sequences/{s['id']}")


def generate(c, seq_id: str, prompt: str | None, max_tokens: int, **kw) -> dict:
    body = {"max_tokens": max_tokens, "temperature": 0, **kw}
    if prompt is not None:
        body["prompt"] = prompt
    r = c.post(f"/v1/sequences/{seq_id}/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def history(c, seq_id: str) -> dict:
    r = c.get(f"/v1/sequences/{seq_id}")
    assert r.status_code == 200, r.text
    return r.json()


def test_fork_a_conversation(srv, c, greedy):
    trunk = c.post("/v1/sequences", json={"prompt": TRUNK}).json()
    assert trunk["object"] == "sequence" and trunk["length"] == len(greedy.tokenizer.encode(TRUNK))
    generate(c, trunk["id"], None, 6)
    trunk_info = history(c, trunk["id"])
    branches = [c.post(f"/v1/sequences/{trunk['id']}/fork", json={}).json() for _ in range(2)]
    assert all(b["parent"] == trunk["id"] and b["length"] == trunk_info["length"] for b in branches)

    cache = srv.cache()  # forks share the trunk's cells: counted once
    assert cache["cells"]["used"] == history(c, trunk["id"])["cells"]["owned"]

    for branch, text in zip(branches, [" JULIET: Ay me!", " MERCUTIO: A plague"]):
        out = generate(c, branch["id"], text, 8)
        assert out["sequence_id"] == branch["id"]
    infos = [history(c, b["id"]) for b in branches]
    assert infos[0]["token_ids"] != infos[1]["token_ids"]
    for info in infos:  # every branch equals a from-scratch greedy completion of its whole history
        ids = info["token_ids"]
        assert ids[: trunk_info["length"]] == trunk_info["token_ids"]
        assert greedy(ids[:-8], 8).token_ids == ids[-8:]
        assert info["text"] == greedy.tokenizer.decode(ids)

    trunk_now = history(c, trunk["id"])
    unique = sum(i["cells"]["owned"] - i["cells"]["shared"] for i in infos)
    used = srv.cache()["cells"]["used"]
    # The trunk's cells count once; prefix sharing may also share cells between the branches (the
    # second one reuses the first one's cell for the trunk's last token), which "unique" leaves out.
    assert trunk_now["cells"]["owned"] + unique <= used <= trunk_now["cells"]["owned"] + unique + 2
    assert used < trunk_now["cells"]["owned"] + sum(i["cells"]["owned"] for i in infos)


def test_create_from_messages_and_stream_a_continuation(c, greedy):
    messages = [{"role": "user", "content": "Who is Juliet?"}]
    seq = c.post("/v1/sequences", json={"messages": messages}).json()
    ids = greedy.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    assert seq["length"] == len(ids)
    body = {"max_tokens": 6, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with c.stream("POST", f"/v1/sequences/{seq['id']}/completions", json=body) as resp:
        assert resp.status_code == 200
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 6
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    info = history(c, seq["id"])
    assert info["token_ids"][: len(ids)] == ids and info["length"] == len(ids) + 6
    assert text == greedy(ids, 6).text


def test_truncate_then_continue_equals_greedy(c, greedy):
    seq = c.post("/v1/sequences", json={"prompt": TRUNK}).json()
    generate(c, seq["id"], None, 6)
    cut = c.post(f"/v1/sequences/{seq['id']}/truncate", json={"length": 5}).json()
    assert cut["length"] == 5
    generate(c, seq["id"], None, 4)
    ids = history(c, seq["id"])["token_ids"]
    assert len(ids) == 9 and greedy(ids[:5], 4).token_ids == ids[5:]


def test_fork_at_a_position(c):
    seq = c.post("/v1/sequences", json={"prompt": TRUNK}).json()
    child = c.post(f"/v1/sequences/{seq['id']}/fork", json={"at": 4}).json()
    assert child["length"] == 4 and child["parent"] == seq["id"]
    assert history(c, child["id"])["token_ids"] == history(c, seq["id"])["token_ids"][:4]


def test_busy_sequence_409_and_fork_snapshots_it(srv, c):
    seq = c.post("/v1/sequences", json={"prompt": TRUNK}).json()
    start = seq["length"]
    body = {"max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    seen = threading.Event()
    result: dict = {}

    def stream() -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as c2, \
                c2.stream("POST", f"/v1/sequences/{seq['id']}/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    seen.set()
            result["status"] = resp.status_code

    t = threading.Thread(target=stream)
    t.start()
    assert seen.wait(30)
    busy = c.post(f"/v1/sequences/{seq['id']}/completions", json={"max_tokens": 2})
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "sequence_busy"
    snap = c.post(f"/v1/sequences/{seq['id']}/fork", json={}).json()
    assert start < snap["length"] < start + LONG_TOKENS
    assert c.get("/v1/sequences").json()["data"]
    c.delete(f"/v1/sequences/{seq['id']}")  # deleting a busy sequence cancels its generation
    t.join(30)
    assert not t.is_alive() and result["status"] == 200
    assert history(c, snap["id"])["length"] == snap["length"]


def test_delete_frees_cells_and_forgets_the_id(srv, c):
    base = srv.cache()["cells"]["used"]
    seq = c.post("/v1/sequences", json={"prompt": TRUNK}).json()
    assert srv.cache()["cells"]["used"] > base
    assert c.delete(f"/v1/sequences/{seq['id']}").json() == {"id": seq["id"], "object": "sequence.deleted",
                                                           "deleted": True}
    assert srv.wait_cells_used(base, timeout=10) == base
    for method, path in [("GET", ""), ("POST", "/fork"), ("DELETE", ""), ("POST", "/completions")]:
        r = c.request(method, f"/v1/sequences/{seq['id']}{path}", json={} if method == "POST" else None)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
