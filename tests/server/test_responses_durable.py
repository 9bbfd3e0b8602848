"""Stored responses with `--state-dir` (server/responses/saved.py): after a restart on the same folder
`GET /v1/responses/{id}`, its input items and `previous_response_id` go on, the continued turn reusing its
history's cells (no re-prefill); a deleted response stays gone; a parent deleted under a stored child is kept
hidden as its history and collected with it; torn or foreign files are skipped."""

import json

import openai
import pytest
from http_support import LiveServer

from engine.api.ids import new_id
from server.generation.constraints import Tool
from server.generation.toolcalls import Prompting
from server.responses.saved import ResponseFiles, _doc
from server.responses.store import ResponseStore, Stored

GREEDY = {"temperature": 0, "max_output_tokens": 8}


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_stored_responses_continue_after_a_restart(model_dir, tmp_path):
    state = tmp_path / "state"
    with LiveServer(model_dir, state_dir=state, n_cells=1024) as srv:
        client = _client(srv)
        r1 = client.responses.create(model="m", input="Hello there", **GREEDY)
        r2 = client.responses.create(model="m", input="And then?", previous_response_id=r1.id, **GREEDY)
        gone = client.responses.create(model="m", input="Bye", **GREEDY)
        client.responses.delete(gone.id)
        r3 = client.responses.create(model="m", input="Go on", previous_response_id=r2.id, **GREEDY)
        items = client.responses.input_items.list(r2.id).model_dump()
        bodies = {r.id: client.responses.retrieve(r.id).model_dump() for r in (r1, r2, r3)}

    with LiveServer(model_dir, state_dir=state, n_cells=1024) as srv:
        client = _client(srv)
        assert {rid: client.responses.retrieve(rid).model_dump() for rid in bodies} == bodies
        assert client.responses.input_items.list(r2.id).model_dump() == items
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone.id)
        # r3 is its sequence's tip: the next turn appends to it, every earlier cell reused
        r4 = client.responses.create(model="m", input="More", previous_response_id=r3.id, **GREEDY)
        assert r4.usage.input_tokens_details.cached_tokens == r3.usage.total_tokens - 1
        # r2 was continued before the restart: continuing it again forks, and says what r3 said
        again = client.responses.create(model="m", input="Go on", previous_response_id=r2.id, **GREEDY)
        assert again.output_text == r3.output_text
        assert again.usage.input_tokens_details.cached_tokens > 0
        assert again.usage.input_tokens_details.cached_tokens >= r2.usage.total_tokens - 1
        client.responses.delete(r1.id)  # r2 continues it: r1 is kept hidden as r2's history

    with LiveServer(model_dir, state_dir=state, n_cells=1024) as srv:
        client = _client(srv)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r1.id)
        assert client.responses.retrieve(r2.id).output_text == r2.output_text
        for rid in (r2.id, r3.id, r4.id, again.id):
            client.responses.delete(rid)
    assert list((state / "responses").iterdir()) == []  # r1 went with its last descendant


def test_a_tip_whose_sequence_went_on_is_forked_not_appended(model_dir):
    """The sequence grew past its tip response (a turn a restart cut short, or a client continuing the sequence
    itself): continuing the response forks at its length, so the model sees exactly its conversation."""
    with LiveServer(model_dir, n_cells=1024) as srv, srv.client() as c:
        client = _client(srv)
        r = client.responses.create(model="m", input="Hello there", **GREEDY)
        expected = client.responses.create(model="m", input="Next", previous_response_id=r.id, store=False, **GREEDY)
        seq = srv.app.state.response_store.by_id[r.id].seq_id
        c.post(f"/v1/sequences/{seq}/completions", json={"max_tokens": 3, "temperature": 0}).raise_for_status()
        got = client.responses.create(model="m", input="Next", previous_response_id=r.id, **GREEDY)
        assert got.output_text == expected.output_text
        assert srv.app.state.response_store.by_id[got.id].seq_id != seq


def _stored(parent: Stored | None = None, seq_id: str | None = None, tools: Prompting | None = None) -> Stored:
    rid = new_id("resp")
    return Stored(rid, seq_id or new_id("seq"), 10 + (parent.length if parent else 0), parent, "be brief", tools,
                  [{"role": "user", "content": "hi"}], {"role": "assistant", "content": "yo"}, "<|end|>",
                  {"id": rid, "object": "response"}, {"enable_thinking": False},
                  [{"type": "message", "role": "user", "content": "hi"}])


def test_files_keep_history_parents_and_skip_bad_records(tmp_path, caplog):
    tool = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})
    store = ResponseStore(2, ResponseFiles(tmp_path))
    a = _stored(tools=Prompting([tool], generic=True, forced=True))
    b = _stored(a, a.seq_id, Prompting([{"type": "function", "function": {"name": "g"}}]))
    c = _stored()
    store.add(a, tip=True)
    store.add(b, tip=True)
    assert store.add(c, tip=True) == []  # a evicted (its sequence still holds b): kept hidden, as b's history
    bad = {"resp-x.json": "{torn", f"{new_id('resp')}.json": json.dumps({"v": 1, "id": "../../etc"})}
    for name, text in bad.items():
        (tmp_path / "responses" / name).write_text(text)

    again = ResponseStore(2, ResponseFiles(tmp_path))
    assert list(again.by_id) == [b.id, c.id] and again.tips == {b.seq_id: b.id, c.seq_id: c.id}
    back = again.by_id[b.id]
    assert back.history() == b.history() and back.parent.tools.tools == [tool] and back.parent.tools.forced
    assert (back.body, back.input_items, back.template_kwargs, back.end_token_text, back.tools) == \
        (b.body, b.input_items, b.template_kwargs, b.end_token_text, b.tools)
    assert "not a valid stored response" in caplog.text
    again.remove(b.id)
    again.forget_sequence(c.seq_id)
    assert {p.name for p in (tmp_path / "responses").iterdir()} == set(bad)  # a went with its last descendant
    assert ResponseStore(2, ResponseFiles(tmp_path)).by_id == {}


def test_a_long_chain_of_turns_loads_without_recursion(tmp_path):
    node = None
    for _ in range(3000):  # deeper than Python's recursion limit
        node = _stored(node, "seq-" + "a" * 32)
    docs, rec = {}, node
    while rec is not None:
        docs[rec.id] = _doc(rec, visible=rec is node)
        rec = rec.parent
    made = {}
    ResponseFiles(tmp_path)._build(node.id, docs, made)
    assert len(made[node.id].history()) == 2 * 3000 and made[node.id].history() == node.history()
