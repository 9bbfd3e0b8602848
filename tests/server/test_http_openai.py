"""OpenAI-compatible routes through the real `openai` SDK and httpx against a live server."""

import openai
import pytest
from http_support import MODEL_NAME, Greedy, LiveServer, sse_events

PROMPT = "ROMEO: But soft, what light"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Juliet?"}]


@pytest.fixture(scope="module")
def srv(model_dir):
    with LiveServer(model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def greedy(model_dir):
    return Greedy(model_dir)


def test_models_and_health(srv, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    with srv.client() as c:
        assert c.get("/health").json() == {"status": "ok"}


def test_greedy_completion_equals_offline_llm(client, greedy):
    ids = greedy.tokenizer.encode(PROMPT)
    expected = greedy(ids, 12)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == len(ids) + len(expected.token_ids)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == expected.text


def test_greedy_chat_equals_offline_llm_on_the_templated_prompt(client, greedy):
    ids = greedy.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    expected = greedy(ids, 10)
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == len(ids)
    alias = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10,
                                           temperature=0)
    assert alias.choices[0].message.content == expected.text


def test_streamed_completion_matches_the_whole_one(client):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_streamed_chat_opens_with_the_role_and_matches_the_whole_one(client):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12,
                                                 temperature=0, stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_raw_sse_framing_and_done(srv):
    body = {"prompt": "Naïve café 日本語 🎉", "max_tokens": 8, "temperature": 0, "stream": True, "echo": True}
    with srv.client() as c, c.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-request-id"].startswith("cmpl-")
        raw = resp.read().decode("utf-8")
    blocks = raw.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks[:-1])
    events = sse_events(raw.splitlines())
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text.startswith("Naïve café 日本語 🎉")  # echoed whole, multibyte characters intact


def test_n_choices_and_seed_reproducibility(client):
    kw = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 1234}
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert 3 <= a.usage.completion_tokens <= 24
    streamed = list(client.completions.create(**kw, stream=True))
    by_index = {i: "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i)
                for i in range(3)}
    assert [by_index[i] for i in range(3)] == [c.text for c in a.choices]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, n=3, seed=7)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


def test_several_prompts_get_consecutive_choice_indexes(client, greedy):
    prompts = ["JULIET: O Romeo", "The quick brown fox"]
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for k, p in enumerate(prompts):
        expected = greedy(greedy.tokenizer.encode(p), 5).text
        assert out.choices[2 * k].text == expected and out.choices[2 * k + 1].text == expected


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and tok in top and len(top) <= 4
        assert max(top.values()) == pytest.approx(value)  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes).decode("utf-8") == entry.token


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = next(ch for ch in text[2:] if ch.isalnum())
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_echo_prefixes_the_prompt(client):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text == PROMPT + base.choices[0].text


def test_sampling_extras_are_accepted(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0.8, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, logit_bias={"5": -100}, user="u1",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "unknown": 1})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4


def test_request_id_header_matches_body(srv):
    with srv.client() as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"]
