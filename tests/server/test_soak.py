"""Soak and fault test (issue #6): a real `cellserve serve` process under a bounded storm of mixed,
concurrent, partly hostile clients, round after round.

Each round has two phases:
- the storm: `clients` workers run a shuffled mix of greedy completions and chats (streamed or not,
  some through the `openai` SDK), sampled n=2 completions, persistent-sequence scenarios (create,
  fork, concurrent continues, truncate + continue, a busy sequence's 409s, cancel or drop, delete),
  explicit cancels (id from X-Request-Id or the first chunk), abrupt disconnects mid-stream and
  mid-wait, and malformed or oversized requests that must get one exact 4xx each; and the hostile
  cases of issue #16: bodies over --max-body-bytes (declared, or chunked past it) -> 413
  body_too_large; lone surrogates -> 400 naming the field; too many prompts, prompts x n beyond
  --max-choices, 4 prompts x n=64 beyond the pool (400 context_length_exceeded), 17 stop strings or
  one of 257 characters -> 400; 200 KB of text -> 400 by its character count, before tokenizing;
  HEAD /health -> 200; POSTs (completions, streamed completions, chat, sequence creates) whose
  client hangs up 0-50 ms after sending;
- the burst: `max_num_seqs + max_queue + 1` long greedy streams and a few short greedy requests are
  sent at once. At least one long stream must be refused with 429 + Retry-After (none can finish
  before it is released, so the last one admitted would find the queue full); every short request
  admitted must produce its reference text. The long streams are then cancelled (half by the
  endpoint, half by dropping the connection, some while still queued) and must have produced a prefix
  of their reference, though short of cells they kept preempting each other. Then, as after the
  storm, the pool must return to its baseline.

After every round: no 5xx anywhere (the server's own error counter agrees, apart from the 503s /health
gave while loading); every greedy request that finished equals its solo reference, itself checked
against the offline `LLM`; every greedy stream cut short (cancelled, dropped, preempted before that)
produced a prefix of its reference; the pool's used/free cells are back to their baseline, no
sequence is left (a create answered an instant before its client's hang-up was noticed may stay: the
server cannot know its answer was lost; those are deleted and counted, and over all rounds must stay
under half the creates that got no answer, where without the roll-back they would all stay), /health
is 200. Across rounds the server's RSS after the warm-up round must grow less than RSS_GROWTH_MB.
Then, on the quiet server, every hostile request above, REJECTED_REPEATS times each: each gets its
exact refusal, nothing is preempted, the cells return, and RSS grows less than RSS_GROWTH_MB. At the
end SIGTERM lets an in-flight stream finish and the process exits 0.

Where the tiny model can outrun a busy client (a cancel arriving after the request finished), both
outcomes are accepted if they are consistent, and counted in the per-round summary. The CI profile
(marker `soak`) takes about a minute on the shared 2-core box; `make soak` also runs the long one.
Timings are printed, never asserted.
"""

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest
from http_support import Greedy
from soak_support import (
    ServerProcess,
    Soak,
    hang_up,
    json_head,
    parse_raw,
    raw_exchange,
    raw_head,
    read_events,
    streamed_text,
)

PROMPTS = ["ROMEO: But soft", "JULIET: O Romeo", "The quick brown fox", "Naïve café 日本語 🎉"]
GREEDY_TOKENS = 12  # every greedy request: temperature 0, ignore_eos, this many tokens
LONG_TOKENS = 460  # streams meant to be cancelled or dropped mid-way (prompt + this fits the 512 context)
N_CELLS, MAX_QUEUE, MAX_NUM_SEQS = 768, 16, 32
RSS_GROWTH_MB = 50.0
MAX_BODY_BYTES = 256 * 1024  # --max-body-bytes: small, so the over-the-limit bodies are cheap to send
HANG_UP_S = 0.05  # early disconnects close the socket 0-50 ms after the request was sent
REJECTED_REPEATS = 6  # each rejected request, this many times, in the RSS check after the rounds
PREEMPTIONS_PER_BURST = 8  # the blockers are released only after this many preemptions
POLL_S = 15.0  # how long a round may take to settle (cells back, nothing running); shared CPUs


@dataclass(frozen=True)
class Profile:
    rounds: int
    clients: int
    scale: int  # the storm mix below, repeated this many times per round
    burst: int  # requests sent into the full queue


MIX = {  # operations per round at scale 1 (71)
    "greedy-cmpl": 5,
    "greedy-cmpl-stream": 4,
    "greedy-chat": 3,
    "greedy-chat-stream": 4,
    "greedy-multi": 2,
    "sdk-cmpl": 2,
    "sdk-chat-stream": 2,
    "sampled-n2": 3,
    "sequence": 5,
    "sequence-delete-busy": 2,
    "cancel": 6,
    "disconnect": 5,
    "disconnect-n3": 2,
    "disconnect-wait": 2,
    "bad": 9,
    "hostile": 4,
    "body-too-large": 2,
    "hang-up-cmpl": 2,
    "hang-up-cmpl-stream": 2,
    "hang-up-chat": 2,
    "hang-up-create": 3,
}


# ----- the solo references -------------------------------------------------------------------
def greedy_request(i: int, chat: bool) -> tuple[str, dict]:
    base = {"max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}
    if chat:
        return "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": PROMPTS[i]}]}
    return "/v1/completions", {**base, "prompt": PROMPTS[i]}


def solo_references(url: str, model_path: str) -> dict:
    """The texts every greedy request must reproduce under load.

    ("cmpl"|"chat", i): GREEDY_TOKENS tokens, each request sent alone to the idle server and checked
    against the offline `LLM`; ("seq", i): a fresh sequence's continuation, sent alone (it must equal
    the completion); ("cmpl-long"|"chat-long", i): LONG_TOKENS tokens from the offline `LLM` (the
    streams that are cancelled or dropped must have produced a prefix of these, preempted or not).
    """
    greedy, refs, long_ids = Greedy(model_path), {}, {}
    with httpx.Client(base_url=url, timeout=120) as c:
        for i in range(len(PROMPTS)):
            for chat in (False, True):
                kind = "chat" if chat else "cmpl"
                path, body = greedy_request(i, chat)
                choice = c.post(path, json=body).raise_for_status().json()["choices"][0]
                refs[(kind, i)] = choice["message"]["content"] if chat else choice["text"]
                tok = {"messages": body["messages"]} if chat else {"prompt": PROMPTS[i]}
                ids = c.post("/tokenize", json=tok).raise_for_status().json()["tokens"]
                assert refs[(kind, i)] == greedy(ids, GREEDY_TOKENS, ignore_eos=True).text, (i, chat)
                assert len(ids) + LONG_TOKENS <= 512, "LONG_TOKENS must fit the tiny model's context"
                long_ids[(f"{kind}-long", i)] = ids
            refs[("seq", i)] = solo_sequence_continuation(c, i)
            assert refs[("seq", i)] == refs[("cmpl", i)]  # a sequence continues exactly like a completion
    refs.update(offline_greedy(greedy, long_ids, LONG_TOKENS))
    return refs


def offline_greedy(greedy: Greedy, prompts: dict, max_tokens: int) -> dict:
    """Greedy texts of several prompts at once, from the offline `LLM` (the same engine, no server),
    and under (kind + "-ids", i) each whole greedy history: prompt ids then generated ids."""
    from engine.api.sampling_params import SamplingParams

    keys = list(prompts)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = greedy.llm.generate([prompts[k] for k in keys], params, use_tqdm=False)
    refs = {k: out.outputs[0].text for k, out in zip(keys, outs)}
    refs.update({(f"{k[0]}-ids", k[1]): prompts[k] + out.outputs[0].token_ids for k, out in zip(keys, outs)})
    return refs


def solo_sequence_continuation(c: httpx.Client, i: int) -> str:
    seq = c.post("/v1/sequences", json={"prompt": PROMPTS[i]}).raise_for_status().json()
    body = {"max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}
    text = (
        c.post(f"/v1/sequences/{seq['id']}/completions", json=body)
        .raise_for_status()
        .json()["choices"][0]["text"]
    )
    c.delete(f"/v1/sequences/{seq['id']}").raise_for_status()
    return text


# ----- storm operations ----------------------------------------------------------------------
async def op_greedy(s: Soak, chat: bool, stream: bool) -> None:
    i = s.rng.randrange(len(PROMPTS))
    path, body = greedy_request(i, chat)
    kind = f"greedy-{'chat' if chat else 'cmpl'}{'-stream' if stream else ''}"
    if stream:
        async with s.stream(kind, path, body) as (_, lines):
            text, finish = streamed_text(await read_events(lines), chat)
    else:
        logprobs = not chat and s.rng.random() < 0.5
        choice = (
            await s.request(kind, "POST", path, json={**body, "logprobs": 2} if logprobs else body)
        ).json()
        choice = choice["choices"][0]
        text, finish = (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]
        if logprobs:
            assert len(choice["logprobs"]["tokens"]) == GREEDY_TOKENS, choice["logprobs"]
    s.check_greedy(kind, ("chat" if chat else "cmpl", i), text, finish)


async def op_greedy_multi(s: Soak) -> None:
    """Two prompts in one completion request: each choice (by index) equals its own solo reference."""
    picks = s.rng.sample(range(len(PROMPTS)), 2)
    body = {**greedy_request(0, chat=False)[1], "prompt": [PROMPTS[i] for i in picks]}
    texts, finishes = ["", ""], [None, None]
    if s.rng.random() < 0.5:
        async with s.stream("greedy-multi-stream", "/v1/completions", body) as (_, lines):
            events = await read_events(lines)
        streamed_text(events, chat=False)  # ended with [DONE], no error event
        choices = [c for e in events[:-1] for c in e["choices"]]
    else:
        choices = (await s.request("greedy-multi", "POST", "/v1/completions", json=body)).json()["choices"]
    for c in choices:
        texts[c["index"]] += c["text"]
        finishes[c["index"]] = c["finish_reason"] or finishes[c["index"]]
    for k, i in enumerate(picks):
        s.check_greedy(f"choice {k} of a two-prompt request", ("cmpl", i), texts[k], finishes[k])


async def op_sdk(s: Soak, chat: bool) -> None:
    """The same greedy requests through the `openai` SDK (it retries nothing; 429s are retried here)."""
    from openai import AsyncOpenAI, RateLimitError

    i = s.rng.randrange(len(PROMPTS))
    sdk = AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    common = {
        "model": "tiny",
        "max_tokens": GREEDY_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    try:
        for _ in range(30):
            try:
                text, finish = await (_sdk_chat(sdk, i, common) if chat else _sdk_completion(sdk, i, common))
                break
            except RateLimitError:
                s.statuses[("sdk", 429)] += 1
                await asyncio.sleep(1.0)
    finally:
        await sdk.close()
    s.statuses[("sdk", 200)] += 1
    s.check_greedy(f"sdk-{'chat' if chat else 'cmpl'}", ("chat" if chat else "cmpl", i), text, finish)


async def _sdk_completion(sdk, i: int, common: dict) -> tuple[str, str]:
    out = await sdk.completions.create(prompt=PROMPTS[i], **common)
    return out.choices[0].text, out.choices[0].finish_reason


async def _sdk_chat(sdk, i: int, common: dict) -> tuple[str, str]:
    stream = await sdk.chat.completions.create(
        messages=[{"role": "user", "content": PROMPTS[i]}], stream=True, **common
    )
    text, finish = "", None
    async for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


async def op_sampled(s: Soak) -> None:
    body = {
        "prompt": s.rng.choice(PROMPTS),
        "max_tokens": 8,
        "temperature": 0.9,
        "top_p": 0.9,
        "seed": s.rng.randrange(1000),
        "n": 2,
    }
    choices = (await s.request("sampled-n2", "POST", "/v1/completions", json=body)).json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1]
    assert all(c["finish_reason"] in ("length", "stop") for c in choices), choices


def long_request(s: Soak, chat: bool) -> tuple[str, dict, tuple]:
    """A greedy request too long to finish before it is cancelled or dropped (usually), and its key."""
    i = s.rng.randrange(len(PROMPTS))
    path, body = greedy_request(i, chat)
    return path, {**body, "max_tokens": LONG_TOKENS}, ("chat-long" if chat else "cmpl-long", i)


def cancel_outcome(s: Soak, kind: str, status: int, finish: str | None) -> None:
    """What a cancel may answer. The tiny model outruns a busy client, so a request may have finished
    before the cancel landed: then 404 (or 200 if its stream was still being sent) and finish 'length'.
    A cancel that landed ends the stream 'cancelled'. Both outcomes are counted and printed."""
    assert status in (200, 404), status
    assert finish in (("cancelled", "length") if status == 200 else ("length",)), (status, finish)
    s.statuses[(kind, "landed" if finish == "cancelled" else "finished first")] += 1


async def op_cancel(s: Soak) -> None:
    """Cancel a stream after a few chunks by its id (header or first chunk); it ends 'cancelled'."""
    chat, by_header = s.rng.random() < 0.5, s.rng.random() < 0.5
    path, body, key = long_request(s, chat)
    async with s.stream("cancel-stream", path, body) as (header_id, lines):
        events = await read_events(lines, limit=3)
        assert events[0]["id"] == header_id
        rid = header_id if by_header else events[0]["id"]
        resp = await s.request("cancel", "POST", f"/v1/requests/{rid}/cancel", expect=(200, 404))
        events += await read_events(lines)
    text, finish = streamed_text(events, chat)
    cancel_outcome(s, "cancel", resp.status_code, finish)
    s.check_prefix("cancelled stream", key, text, finish)
    await s.request("cancel-finished", "POST", f"/v1/requests/{rid}/cancel", expect=(404,))


async def op_disconnect(s: Soak) -> None:
    """Drop the connection after a few chunks (leaving the block closes it mid-stream)."""
    chat = s.rng.random() < 0.5
    path, body, key = long_request(s, chat)
    async with s.stream("disconnect-stream", path, body) as (_, lines):
        events = await read_events(lines, limit=s.rng.randint(2, 5))
    text = "".join(
        (c["delta"].get("content") or "") if chat else c["text"] for e in events for c in e["choices"]
    )
    s.check_prefix("stream before the drop", key, text, None)


async def op_disconnect_n(s: Soak) -> None:
    """Drop an n=3 sampled stream (prefilled once, forked into 3) early: maybe before it forked.
    200 tokens, so that 3 choices fit the pool."""
    body = {"prompt": s.rng.choice(PROMPTS), "max_tokens": 200, "temperature": 0.8, "seed": 1, "n": 3}
    async with s.stream("disconnect-n3", "/v1/completions", body) as (_, lines):
        await read_events(lines, limit=s.rng.randint(1, 4))


async def op_disconnect_wait(s: Soak) -> None:
    """A non-streaming request whose client gives up waiting (read timeout) and hangs up."""
    path, body, _ = long_request(s, s.rng.random() < 0.5)
    try:
        resp = await s.http.post(path, json=body, timeout=httpx.Timeout(60, read=0.3))
    except httpx.ReadTimeout:
        s.statuses[("disconnect-wait", "gave up")] += 1
        return
    s.record("disconnect-wait", resp, resp.content)  # finished or refused in time: still no 5xx


BAD_TOKEN_PROMPT = [5] * 600  # beyond the 512-token context
BAD = [  # (what, method, path, request kwargs, the one status it must get)
    ("truncated JSON", "POST", "/v1/completions", {"content": b'{"prompt": "x", "max_tokens": '}, 400),
    ("binary garbage", "POST", "/v1/chat/completions", {"content": b"\xff\xfe\x00garbage"}, 400),
    ("JSON list body", "POST", "/v1/completions", {"json": [1, 2, 3]}, 400),
    ("prompt of wrong type", "POST", "/v1/completions", {"json": {"prompt": 5}}, 400),
    ("negative max_tokens", "POST", "/v1/completions", {"json": {"prompt": "x", "max_tokens": -3}}, 400),
    ("max_tokens as string", "POST", "/v1/completions", {"json": {"prompt": "x", "max_tokens": "8"}}, 400),
    ("temperature out of range", "POST", "/v1/completions", {"json": {"prompt": "x", "temperature": 7}}, 400),
    ("empty messages", "POST", "/v1/chat/completions", {"json": {"messages": []}}, 400),
    (
        "unknown role",
        "POST",
        "/v1/chat/completions",
        {"json": {"messages": [{"role": "wiz", "content": "x"}]}},
        400,
    ),
    ("bad logit_bias key", "POST", "/v1/completions", {"json": {"prompt": "x", "logit_bias": {"a": 1}}}, 400),
    (
        "stream_options without stream",
        "POST",
        "/v1/completions",
        {"json": {"prompt": "x", "stream_options": {"include_usage": True}}},
        400,
    ),
    ("prompt beyond context (ids)", "POST", "/v1/completions", {"json": {"prompt": BAD_TOKEN_PROMPT}}, 400),
    ("prompt beyond context (text)", "POST", "/v1/completions", {"json": {"prompt": "ROMEO: " * 400}}, 400),
    (
        "max_tokens beyond context",
        "POST",
        "/v1/chat/completions",
        {"json": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}},
        400,
    ),
    (
        "n choices beyond the pool",
        "POST",
        "/v1/completions",
        {"json": {"prompt": "x", "n": 2, "max_tokens": 500}},
        400,
    ),
    ("create with neither prompt nor messages", "POST", "/v1/sequences", {"json": {}}, 400),
    ("continue an unknown sequence", "POST", "/v1/sequences/seq-nope/completions", {"json": {}}, 404),
    ("fork an unknown sequence", "POST", "/v1/sequences/seq-nope/fork", {"json": {}}, 404),
    ("delete an unknown sequence", "DELETE", "/v1/sequences/seq-nope", {}, 404),
    ("cancel an unknown request", "POST", "/v1/requests/cmpl-nope/cancel", {}, 404),
]


async def op_bad(s: Soak) -> None:
    for what, method, path, kw, status in s.rng.sample(BAD, 3):
        await s.request(f"bad: {what}", method, path, expect=(status,), retry_429=False, **kw)


# ----- hostile requests (issue #16): refused before any work, whatever runs at the same time -----
def surrogate_body(template: str) -> dict:
    """`template` as a JSON body, its @ replaced by a string of lone surrogate escapes (valid JSON, not
    valid Unicode)."""
    return {"content": template.replace("@", '"\\ud800 x \\udfff"').encode(),
            "headers": {"content-type": "application/json"}}


FAR_BEYOND_CONTEXT = "abcd " * 40_000  # 200 KB, under --max-body-bytes; ~3000x what the context can hold
HOSTILE = [  # (what, method, path, request kwargs, status, error code or None, param or None)
    ("prompt of lone surrogates", "POST", "/v1/completions",
     surrogate_body('{"prompt": @, "max_tokens": 4}'), 400, None, "prompt"),
    ("chat content of lone surrogates", "POST", "/v1/chat/completions",
     surrogate_body('{"messages": [{"role": "user", "content": @}]}'), 400, None,
     "messages[0].content"),
    ("sequence prompt of lone surrogates", "POST", "/v1/sequences",
     surrogate_body('{"prompt": @}'), 400, None, "prompt"),
    ("too many prompts (--max-prompts 256)", "POST", "/v1/completions",
     {"json": {"prompt": ["a"] * 257, "max_tokens": 1}}, 400, "too_many_prompts", "prompt"),
    ("prompts x n beyond --max-choices 1024", "POST", "/v1/completions",
     {"json": {"prompt": ["a"] * 64, "n": 17, "max_tokens": 1}}, 400, "too_many_choices", "n"),
    ("4 prompts x n=64 beyond the pool", "POST", "/v1/completions",
     {"json": {"prompt": ["a", "b", "c", "d"], "n": 64, "max_tokens": 100}}, 400, "context_length_exceeded",
     None),
    ("17 stop strings", "POST", "/v1/completions",
     {"json": {"prompt": "x", "stop": [f"s{k}" for k in range(17)]}}, 400, None, "stop"),
    ("a stop string of 257 characters", "POST", "/v1/chat/completions",
     {"json": {"messages": [{"role": "user", "content": "x"}], "stop": "s" * 257}}, 400, None, "stop"),
    ("200 KB of text far beyond the context", "POST", "/v1/completions",
     {"json": {"prompt": FAR_BEYOND_CONTEXT}}, 400, "context_length_exceeded", "prompt"),
    ("200 KB of chat text far beyond the context", "POST", "/v1/chat/completions",
     {"json": {"messages": [{"role": "user", "content": FAR_BEYOND_CONTEXT}]}}, 400, "context_length_exceeded",
     "messages"),
]


async def hostile_request(s: Soak, entry: tuple) -> None:
    """One HOSTILE entry: its exact status, error code and param; text beyond the context must be
    refused by the character count, i.e. before it was tokenized."""
    what, method, path, kw, status, code, param = entry
    resp = await s.request(f"hostile: {what}", method, path, expect=(status,), retry_429=False, **kw)
    err = resp.json()["error"]
    assert code is None or err["code"] == code, f"{what}: code {err['code']!r}, want {code!r}"
    assert param is None or err["param"] == param, f"{what}: param {err['param']!r}, want {param!r}"
    if "200 KB" in what:
        assert "non-whitespace characters" in err["message"], f"{what}: tokenized first? {err['message']}"


async def op_hostile(s: Soak) -> None:
    for entry in s.rng.sample(HOSTILE, 3):
        await hostile_request(s, entry)
    await s.request("hostile: HEAD /health", "HEAD", "/health", retry_429=False)


def port_of(s: Soak) -> int:
    return int(s.url.rsplit(":", 1)[1])


async def body_too_large(s: Soak, how: str) -> None:
    """A body over --max-body-bytes is a 413 `body_too_large` before the server reads it: declared by
    Content-Length (here 20 MiB, of which nothing is sent: the answer comes anyway), or sent chunked
    without a length (refused as soon as the bytes received pass the limit)."""
    port, limit = port_of(s), MAX_BODY_BYTES
    if how == "declared":
        head = raw_head("POST", "/v1/completions", port,
                        {"Content-Type": "application/json", "Content-Length": str(20 * 2**20)})
        resp = await raw_exchange(port, head)
    else:
        head = raw_head("POST", "/v1/chat/completions", port,
                        {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        size = 32 * 1024
        parts = [b"%x\r\n" % size + b"a" * size + b"\r\n" for _ in range(limit // size)]
        parts.append(b"1\r\na")  # one byte past the limit; nothing after it, so nothing is left unread
        resp = await raw_exchange(port, head, parts)
    s.record(f"body-too-large ({how})", resp, resp.content)
    assert resp.status_code == 413, f"{how}: {resp.status_code} {resp.content[:200]!r}"
    assert resp.json()["error"]["code"] == "body_too_large", resp.content[:300]


async def op_body_too_large(s: Soak) -> None:
    await body_too_large(s, s.rng.choice(["declared", "chunked"]))


async def op_hang_up(s: Soak, kind: str) -> None:
    """A POST whose client closes the socket 0-50 ms after sending it (fully, or only its sending side,
    which lets it read what the server answered before it noticed). Nothing to check here but the
    status of whatever came back; the round's checks (no 5xx counted by the server, cells back to the
    baseline, no sequence left) are what such a client must not break."""
    port, i = port_of(s), s.rng.randrange(len(PROMPTS))
    path, body = greedy_request(i, chat=kind == "chat")
    body = {**body, "max_tokens": LONG_TOKENS, "stream": kind == "cmpl-stream"}
    raw = json.dumps(body).encode()
    data = await hang_up(port, json_head("POST", path, port, raw) + raw, s.rng.uniform(0, HANG_UP_S),
                         half_close=s.rng.random() < 0.5)
    resp = parse_raw(data)
    if resp is None:
        s.statuses[(f"hang-up-{kind}", "nothing back")] += 1
    else:
        s.record(f"hang-up-{kind}", resp, None if resp.status_code == 200 else resp.content)


HANG_UP_MARK = "hang-up create "


async def op_hang_up_create(s: Soak) -> None:
    """POST /v1/sequences whose client half-closes 0-50 ms after sending. If it got the answer it owns
    the sequence and deletes it; if not, the create must have been rolled back. The server cannot know
    whether an answer it wrote got through, so a sequence created an instant before the hang-up was
    noticed may stay: `reap_hang_up_orphans` removes those (they carry HANG_UP_MARK) and counts them,
    and the test bounds their number by the creates that got no answer."""
    port = port_of(s)
    raw = json.dumps({"prompt": HANG_UP_MARK + s.rng.choice(PROMPTS)}).encode()
    data = await hang_up(port, json_head("POST", "/v1/sequences", port, raw) + raw, s.rng.uniform(0, HANG_UP_S),
                         half_close=True)
    resp = parse_raw(data)
    try:
        seq_id = resp.json()["id"] if resp is not None and resp.status_code == 200 else None
    except ValueError:  # cut mid-body
        seq_id = None
    if resp is not None:
        s.record("hang-up-create", resp, None if resp.status_code == 200 else resp.content)
    if seq_id is None:
        s.statuses[("hang-up-create", "no answer")] += 1
        return
    s.statuses[("hang-up-create", "answered")] += 1
    await s.request("seq-delete", "DELETE", f"/v1/sequences/{seq_id}")


async def reap_hang_up_orphans(s: Soak) -> int:
    """After the storm (every other operation deleted its sequences): any sequence left must be a
    hang-up create answered into a closed socket; delete them and return how many."""
    orphans = (await s.request("seq-list", "GET", "/v1/sequences")).json()["data"]
    for seq in orphans:
        text = (await s.request("seq-get", "GET", f"/v1/sequences/{seq['id']}")).json()["text"]
        assert HANG_UP_MARK in text, f"sequence {seq['id']} left behind by the storm: {text[:80]!r}"
        await s.request("seq-delete", "DELETE", f"/v1/sequences/{seq['id']}")
    s.statuses[("hang-up-create", "orphaned")] += len(orphans)
    return len(orphans)


# ----- the sequence scenario -----------------------------------------------------------------
async def seq_continue(s: Soak, seq_id: str, i: int, stream: bool) -> None:
    """A greedy continuation of a fresh (or rewound) sequence equals the solo reference."""
    path = f"/v1/sequences/{seq_id}/completions"
    body = {"max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}
    if stream:
        async with s.stream("seq-continue-stream", path, body) as (_, lines):
            text, finish = streamed_text(await read_events(lines), chat=False)
    else:
        choice = (await s.request("seq-continue", "POST", path, json=body)).json()["choices"][0]
        text, finish = choice["text"], choice["finish_reason"]
    s.check_greedy(f"sequence continuation ({'stream' if stream else 'json'})", ("seq", i), text, finish)


async def seq_busy_then_stop(s: Soak, seq_id: str, i: int, ids: list[str]) -> None:
    """While a fresh sequence (prompt i) generates: a second generation and a truncate are 409, a fork
    snapshots what it has so far; then it is cancelled (endpoint) or abandoned (dropped connection),
    goes idle keeping what it made, and the fork's tokens are a prefix of its tokens.

    If the long generation already finished (a busy client reads slowly), the probes are accepted
    (200): then they must say so consistently, and only what still holds is checked."""
    path = f"/v1/sequences/{seq_id}"
    length = (await s.request("seq-get", "GET", path)).json()["length"]
    body = {"max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}
    async with s.stream("seq-long-stream", f"{path}/completions", body) as (rid, lines):
        events = await read_events(lines, limit=2)
        probes = [
            (
                await s.request(
                    "seq-busy", "POST", f"{path}/completions", json={"max_tokens": 2}, expect=(409, 200)
                )
            ).status_code,
            (
                await s.request(
                    "seq-busy", "POST", f"{path}/truncate", json={"length": length}, expect=(409, 200)
                )
            ).status_code,
        ]
        snap = (await s.request("seq-fork-busy", "POST", f"{path}/fork")).json()
        ids.append(snap["id"])
        finish = None
        if s.rng.random() < 0.5:
            cancel = await s.request("seq-cancel", "POST", f"/v1/requests/{rid}/cancel", expect=(200, 404))
            text, finish = streamed_text(events + await read_events(lines), chat=False)
            cancel_outcome(s, "seq-cancel", cancel.status_code, finish)
            if probes == [409, 409]:
                s.check_prefix("cancelled sequence continuation", ("cmpl-long", i), text, finish)
    info = await wait_sequence_idle(s, seq_id)
    if probes != [409, 409]:
        assert finish in (None, "length"), (probes, finish)  # a probe got through: the stream had ended
        return
    s.statuses[("seq-busy", "both 409")] += 1
    assert length < info["length"] <= length + LONG_TOKENS, info["length"]
    tokens = (await s.request("seq-get", "GET", f"/v1/sequences/{snap['id']}")).json()["token_ids"]
    assert length <= len(tokens) <= info["length"] and tokens == info["token_ids"][: len(tokens)]


async def op_sequence_delete_busy(s: Soak) -> None:
    """DELETE a sequence mid-generation after forking it: the stream ends at once (cancelled, or by
    length if it had already finished), the sequence is gone, and the fork, whose cells were shared
    with the deleted parent, continues on the very same greedy path (token ids checked)."""
    i, ids = s.rng.randrange(len(PROMPTS)), []
    try:
        seq = (await s.request("seq-create", "POST", "/v1/sequences", json={"prompt": PROMPTS[i]})).json()
        ids.append(seq["id"])
        body = {"max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}
        async with s.stream("seq-long-stream", f"/v1/sequences/{seq['id']}/completions", body) as (_, lines):
            events = await read_events(lines, limit=2)
            snap = (await s.request("seq-fork-busy", "POST", f"/v1/sequences/{seq['id']}/fork")).json()
            ids.append(snap["id"])
            await s.request("seq-delete-busy", "DELETE", f"/v1/sequences/{seq['id']}")
            ids.remove(seq["id"])
            text, finish = streamed_text(events + await read_events(lines), chat=False)
        assert finish in ("cancelled", "length"), finish
        s.check_prefix("deleted sequence's stream", ("cmpl-long", i), text, finish)
        await s.request("seq-deleted", "GET", f"/v1/sequences/{seq['id']}", expect=(404,))
        await s.request(
            "seq-deleted", "POST", f"/v1/sequences/{seq['id']}/completions", json={}, expect=(404,)
        )
        cont = {"max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}
        await s.request("seq-continue", "POST", f"/v1/sequences/{snap['id']}/completions", json=cont)
        tokens = (await s.request("seq-get", "GET", f"/v1/sequences/{snap['id']}")).json()["token_ids"]
        full = s.refs[("cmpl-long-ids", i)]
        n = min(len(tokens), len(full))
        assert tokens[:n] == full[:n], "the fork of a deleted sequence left the greedy path"
        s.greedy_checked += 1
    finally:
        for sid in ids:
            await s.request("seq-delete", "DELETE", f"/v1/sequences/{sid}")


async def wait_sequence_idle(s: Soak, seq_id: str) -> dict:
    deadline = time.monotonic() + POLL_S
    while True:
        info = (await s.request("seq-get", "GET", f"/v1/sequences/{seq_id}")).json()
        if info["status"] == "idle" or time.monotonic() > deadline:
            assert info["status"] == "idle", info["status"]
            return info
        await asyncio.sleep(0.05)


async def op_sequence(s: Soak) -> None:
    """create -> fork -> both continue at once -> rewind + continue -> bad verbs -> busy -> delete all."""
    i, ids = s.rng.randrange(len(PROMPTS)), []
    try:
        seq = (await s.request("seq-create", "POST", "/v1/sequences", json={"prompt": PROMPTS[i]})).json()
        ids.append(seq["id"])
        n = seq["length"]
        child = (await s.request("seq-fork", "POST", f"/v1/sequences/{seq['id']}/fork")).json()
        ids.append(child["id"])
        assert child["length"] == n and child["parent"] == seq["id"]
        await asyncio.gather(
            seq_continue(s, seq["id"], i, stream=False), seq_continue(s, child["id"], i, stream=True)
        )
        rewound = (
            await s.request("seq-truncate", "POST", f"/v1/sequences/{seq['id']}/truncate", json={"length": n})
        ).json()
        assert rewound["length"] == n
        await seq_continue(s, seq["id"], i, stream=s.rng.random() < 0.5)
        await s.request(
            "seq-bad", "POST", f"/v1/sequences/{seq['id']}/truncate", json={"length": 0}, expect=(400,)
        )
        await s.request(
            "seq-bad", "POST", f"/v1/sequences/{seq['id']}/fork", json={"at": 10**6}, expect=(400,)
        )
        grand = (
            await s.request("seq-fork", "POST", f"/v1/sequences/{child['id']}/fork", json={"at": n})
        ).json()
        ids.append(grand["id"])
        await seq_busy_then_stop(s, grand["id"], i, ids)
    finally:
        for sid in ids:
            await s.request("seq-delete", "DELETE", f"/v1/sequences/{sid}")
    for sid in ids:
        await s.request("seq-deleted", "GET", f"/v1/sequences/{sid}", expect=(404,))
        await s.request("seq-deleted", "DELETE", f"/v1/sequences/{sid}", expect=(404,))


OPS = {
    "greedy-cmpl": lambda s: op_greedy(s, chat=False, stream=False),
    "greedy-cmpl-stream": lambda s: op_greedy(s, chat=False, stream=True),
    "greedy-chat": lambda s: op_greedy(s, chat=True, stream=False),
    "greedy-chat-stream": lambda s: op_greedy(s, chat=True, stream=True),
    "sdk-cmpl": lambda s: op_sdk(s, chat=False),
    "sdk-chat-stream": lambda s: op_sdk(s, chat=True),
    "sampled-n2": op_sampled,
    "sequence": op_sequence,
    "sequence-delete-busy": op_sequence_delete_busy,
    "cancel": op_cancel,
    "disconnect": op_disconnect,
    "disconnect-wait": op_disconnect_wait,
    "disconnect-n3": op_disconnect_n,
    "greedy-multi": op_greedy_multi,
    "bad": op_bad,
    "hostile": op_hostile,
    "body-too-large": op_body_too_large,
    "hang-up-cmpl": lambda s: op_hang_up(s, "cmpl"),
    "hang-up-cmpl-stream": lambda s: op_hang_up(s, "cmpl-stream"),
    "hang-up-chat": lambda s: op_hang_up(s, "chat"),
    "hang-up-create": op_hang_up_create,
}


async def storm(s: Soak, profile: Profile) -> list[str]:
    """Run the shuffled mix on `profile.clients` workers; return every failed operation's message."""
    plan = [name for name, count in MIX.items() for _ in range(count * profile.scale)]
    s.rng.shuffle(plan)
    failures: list[str] = []

    async def worker() -> None:
        while plan:
            name = plan.pop()
            try:
                await OPS[name](s)
            except Exception as exc:  # noqa: BLE001 -- collected, reported together after the round
                failures.append(f"{name}: {type(exc).__name__}: {exc}")

    await asyncio.gather(*(worker() for _ in range(profile.clients)))
    return failures


# ----- the burst beyond --max-queue ----------------------------------------------------------
async def blocker(s: Soak, k: int, status: asyncio.Future, release: asyncio.Event) -> None:
    """A long greedy stream that holds its place until released; then cancelled (even k) or dropped
    (odd k). `status` gets its HTTP status as soon as it is answered (429 if the queue was full)."""
    i = k % len(PROMPTS)
    body = {
        "prompt": PROMPTS[i],
        "max_tokens": LONG_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with s.http.stream("POST", "/v1/completions", json=body) as resp:
            s.record("blocker", resp, None if resp.status_code == 200 else await resp.aread())
            status.set_result(resp.status_code)
            assert resp.status_code in (200, 429), resp.status_code
            if resp.status_code == 429:
                return
            await release.wait()
            if k % 2:
                return
            rid = resp.headers["x-request-id"]
            cancel = await s.request(
                "blocker-cancel", "POST", f"/v1/requests/{rid}/cancel", expect=(200, 404)
            )
            events = await read_events(resp.aiter_lines())
    except BaseException as exc:
        if not status.done():
            status.set_exception(exc)
        raise
    text, finish = streamed_text(events, chat=False)
    cancel_outcome(s, "blocker-cancel", cancel.status_code, finish)
    s.check_prefix("blocker (preempted and resumed under cell pressure)", ("cmpl-long", i), text, finish)


async def burst_one(s: Soak, k: int, status: asyncio.Future) -> None:
    """A short greedy request sent with the blockers: 429, or admitted (200) and then, once it gets
    its turn, exactly its reference text."""
    i, chat = k % len(PROMPTS), bool(k % 2)
    path, body = greedy_request(i, chat)
    try:
        async with s.http.stream("POST", path, json={**body, "stream": True}) as resp:
            s.record("burst", resp, None if resp.status_code == 200 else await resp.aread())
            status.set_result(resp.status_code)
            assert resp.status_code in (200, 429), resp.status_code
            if resp.status_code == 429:
                return
            events = await read_events(resp.aiter_lines())
    except BaseException as exc:
        if not status.done():
            status.set_exception(exc)
        raise
    s.check_greedy("burst request admitted", ("chat" if chat else "cmpl", i), *streamed_text(events, chat))


async def burst(s: Soak, srv: ServerProcess, n: int) -> list[int]:
    """`max_num_seqs + max_queue + 1` blockers and `n` short greedy requests, all at once; once every one
    is answered the blockers are released (cancelled or dropped, maybe while still queued).

    At least one blocker must be refused (429), whatever the timing: blockers do not finish before
    they are released, so the last of them to be admitted would find `running + waiting >=
    max_num_seqs + max_queue`, i.e. a full queue. Returns the blockers' statuses."""
    loop = asyncio.get_running_loop()
    release = asyncio.Event()
    n_blockers = srv.max_num_seqs + srv.max_queue + 1
    blocked = [loop.create_future() for _ in range(n_blockers)]
    shorts = [loop.create_future() for _ in range(n)]
    tasks = [asyncio.create_task(blocker(s, k, blocked[k], release)) for k in range(n_blockers)]
    tasks += [asyncio.create_task(burst_one(s, k, shorts[k])) for k in range(n)]
    try:
        before = (await s.request("cache", "GET", "/v1/cache")).json()["preemptions"]
        statuses = await asyncio.gather(*blocked)
        others = await asyncio.gather(*shorts)
        held = await wait_preemptions(s, before + PREEMPTIONS_PER_BURST)
        print(
            f"  burst: blockers {dict(Counter(statuses))}, short requests {dict(Counter(others))}, "
            f"engine {held['requests']}, {held['preemptions'] - before} preemptions"
        )
    finally:
        release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    return statuses


async def wait_preemptions(s: Soak, at_least: int) -> dict:
    """Poll until the engine has preempted `at_least` times in all: the blockers outgrow the pool
    (`max_num_seqs` sequences of 24+ tokens fill 768 cells), so preemption must come; the blockers'
    prefix checks then cover preempted-and-resumed streams. Returns the last /v1/cache body."""
    deadline = time.monotonic() + 120
    while True:
        body = (await s.request("cache", "GET", "/v1/cache")).json()
        if body["preemptions"] >= at_least:
            return body
        assert time.monotonic() < deadline, f"no preemption under cell pressure: {body['requests']}"
        await asyncio.sleep(0.05)


def live_cells(cache_body: dict) -> dict:
    """The pool as requests see it: cells held only by cached prefixes count as free (evicted on demand)."""
    return {k: cache_body["cells"][k] for k in ("total", "used", "free")}


async def settle(s: Soak, baseline: dict, when: str) -> dict:
    """Poll until nothing runs or waits and the cells are back to `baseline` (or POLL_S passed); assert
    it, and no sequence is left; return the last /v1/cache body. The wait is printed."""
    t0 = time.monotonic()
    while True:
        body = (await s.request("cache", "GET", "/v1/cache")).json()
        settled = body["requests"] == {"running": 0, "waiting": 0} and live_cells(body) == baseline
        if settled or time.monotonic() - t0 > POLL_S:
            break
        await asyncio.sleep(0.05)
    print(f"  {when}: settled in {time.monotonic() - t0:.2f}s, {body['preemptions']} preemptions so far")
    assert body["requests"] == {"running": 0, "waiting": 0}, f"{when}: {body['requests']}"
    assert live_cells(body) == baseline, f"{when}: cells {body['cells']} != baseline {baseline} (leak)"
    assert body["sequences"] == [], f"{when}: sequences left: {[q['id'] for q in body['sequences']]}"
    return body


# ----- rounds and the test -------------------------------------------------------------------
async def run_round(srv: ServerProcess, profile: Profile, refs: dict, baseline: dict, r: int) -> Soak:
    """One storm then one burst on a fresh client, each followed by a return to the baseline."""
    s = Soak(srv.url, random.Random(1000 + r), refs, max_connections=256)
    try:
        failures = await storm(s, profile)
        assert not failures, f"round {r}: {len(failures)} operations failed:\n" + "\n".join(
            failures + s.problems
        )
        await reap_hang_up_orphans(s)
        await settle(s, baseline, f"round {r} storm")
        statuses = await burst(s, srv, profile.burst)
        assert 429 in statuses, f"round {r}: no blocker refused, yet they cannot all fit: {statuses}"
        await settle(s, baseline, f"round {r} burst")
    finally:
        await s.aclose()
    return s


def server_5xx(url: str) -> dict:
    """What the server itself counted as answered with a 5xx (cellserve:request_errors_total by status)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        s.labels["status"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "cellserve:request_errors_total"
        and s.labels.get("status", "").startswith("5")
        and s.value
    }


def check_round(srv: ServerProcess, s: Soak, loading_503: dict, r: int) -> float:
    """What a finished round must leave behind beyond the baseline cells; returns the server's RSS (MiB).
    The only 5xx the server may have counted are the 503s /health gave while loading (`loading_503`)."""
    assert not s.problems, f"round {r}: contract violations:\n" + "\n".join(s.problems)
    assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    assert server_5xx(srv.url) == loading_503
    rss = srv.rss_mb()
    http, outcomes = Counter(), Counter()
    for (kind, status), n in s.statuses.items():
        if isinstance(status, int):
            http[status] += n
        else:
            outcomes[f"{kind}: {status}"] += n
    print(
        f"round {r}: {sum(http.values())} responses {dict(sorted(http.items()))}; "
        f"{dict(sorted(outcomes.items()))}; {s.greedy_checked} greedy texts checked; RSS {rss:.1f} MiB"
    )
    return rss


async def rejected_batch(srv: ServerProcess, refs: dict, baseline: dict) -> tuple[float, float]:
    """Every HOSTILE request and both over-the-limit bodies, REJECTED_REPEATS times each, 8 at a time, on
    the quiet server after the rounds. Each gets its exact refusal; none of them runs: the preemption
    count does not move (4 prompts x n=64 would need more cells than the pool) and the cells return to
    the baseline. Returns the server's RSS (MiB) before and after."""
    s = Soak(srv.url, random.Random(7), refs)
    try:
        before = await settle(s, baseline, "before the rejected requests")
        rss_before = srv.rss_mb()
        jobs = [lambda e=e: hostile_request(s, e) for e in HOSTILE]
        jobs += [lambda how=how: body_too_large(s, how) for how in ("declared", "chunked")]
        jobs = jobs * REJECTED_REPEATS
        sem = asyncio.Semaphore(8)

        async def run(job) -> None:
            async with sem:
                await job()

        t0 = time.monotonic()
        await asyncio.gather(*(run(job) for job in jobs))
        elapsed = time.monotonic() - t0
        after = await settle(s, baseline, "after the rejected requests")
        assert not s.problems, "\n".join(s.problems)
        assert after["preemptions"] == before["preemptions"], "a refused request preempted others"
        rss_after = srv.rss_mb()
    finally:
        await s.aclose()
    print(f"rejected requests: {len(jobs)} answered in {elapsed:.2f}s; RSS {rss_before:.1f} -> {rss_after:.1f} MiB")
    return rss_before, rss_after


async def settle_once(url: str, refs: dict, baseline: dict) -> None:
    s = Soak(url, random.Random(0), refs)
    try:
        await settle(s, baseline, "references")
    finally:
        await s.aclose()


async def drain_on_sigterm(srv: ServerProcess) -> list:
    """SIGTERM while a stream is in flight: the stream still finishes (graceful drain)."""
    path, body = greedy_request(0, chat=False)
    async with (
        httpx.AsyncClient(base_url=srv.url, timeout=120) as c,
        c.stream("POST", path, json={**body, "max_tokens": 40, "stream": True}) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.aiter_lines()
        events = await read_events(lines, limit=1)
        srv.proc.terminate()  # SIGTERM
        return events + await read_events(lines)


@pytest.fixture
def make_server(model_dir, tmp_path):
    """Builds the server process; teardown always ends it, even when the test failed."""
    started: list[ServerProcess] = []

    def make() -> ServerProcess:
        srv = ServerProcess(
            model_dir, tmp_path / "serve.log", n_cells=N_CELLS, max_queue=MAX_QUEUE, max_num_seqs=MAX_NUM_SEQS,
            max_body_bytes=MAX_BODY_BYTES,
        )
        started.append(srv)
        srv.start()
        return srv

    yield make
    for srv in started:
        if srv.proc is not None and srv.proc.poll() is None:
            print("server log tail:\n" + srv.log_tail())
        srv.kill()


PROFILES = [
    pytest.param(Profile(rounds=3, clients=12, scale=1, burst=8), marks=pytest.mark.soak, id="ci"),
    pytest.param(Profile(rounds=12, clients=24, scale=2, burst=16), marks=pytest.mark.soak_long, id="long"),
]


@pytest.mark.parametrize("profile", PROFILES)
def test_soak(profile: Profile, make_server, model_dir):
    t0 = time.monotonic()
    srv = make_server()
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        baseline = live_cells(c.get("/v1/cache").raise_for_status().json())
    loading_503 = server_5xx(srv.url)
    assert set(loading_503) <= {"503"}
    refs = solo_references(srv.url, model_dir)
    asyncio.run(settle_once(srv.url, refs, baseline))
    print(f"\nserver up and references checked in {time.monotonic() - t0:.1f}s; baseline cells {baseline}")
    rss, hang_ups = [], Counter()
    for r in range(profile.rounds):
        s = asyncio.run(run_round(srv, profile, refs, baseline, r))
        rss.append(check_round(srv, s, loading_503, r))
        hang_ups.update({k[1]: n for k, n in s.statuses.items() if k[0] == "hang-up-create"})
    # Without the roll-back every create that got no answer would leave its sequence behind.
    assert hang_ups["orphaned"] <= hang_ups["no answer"] // 2, f"creates whose client left were kept: {hang_ups}"
    growth = rss[-1] - rss[0]
    print(
        f"RSS (MiB) after each round: {[round(x, 1) for x in rss]}; growth after the warm-up round "
        f"{growth:+.1f} MiB (max {max(rss) - rss[0]:+.1f}), bound {RSS_GROWTH_MB} MiB"
    )
    assert growth < RSS_GROWTH_MB
    rss_before, rss_after = asyncio.run(rejected_batch(srv, refs, baseline))
    assert rss_after - rss_before < RSS_GROWTH_MB, f"RSS {rss_before:.1f} -> {rss_after:.1f} MiB"
    _, finish = streamed_text(asyncio.run(drain_on_sigterm(srv)), chat=False)
    assert finish == "length"  # the in-flight stream was finished, not cut
    assert srv.proc.wait(60) == 0, srv.log_tail()
    print(f"total {time.monotonic() - t0:.1f}s")
