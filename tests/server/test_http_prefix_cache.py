"""Prefix sharing as a client sees it (issue #12), through a real server: the same system prompt on
every chat request, and a multi-turn conversation resent in full, are served from cached cells;
`usage.prompt_tokens_details.cached_tokens`, `/v1/cache` and the Prometheus counters say so; the
text is the same as with the cache off; `--no-prefix-cache` turns it off."""

import openai
import pytest
from http_support import MODEL_NAME, LiveServer, metric_value

SYSTEM = ("You are a careful assistant who answers in the voice of a Shakespearean actor, briefly, "
          "and never forgets the question that was asked of him.")


def chat(client: openai.OpenAI, messages: list[dict], stream: bool = False):
    common = {"model": MODEL_NAME, "messages": messages, "max_tokens": 8, "temperature": 0}
    if not stream:
        return client.chat.completions.create(**common)
    chunks = list(client.chat.completions.create(**common, stream=True, stream_options={"include_usage": True}))
    return chunks


@pytest.fixture(scope="module")
def servers(model_dir):
    with LiveServer(model_dir, n_cells=2048) as on, LiveServer(model_dir, n_cells=2048, prefix_caching=False) as off:
        yield on, off


def sdk(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_a_repeated_system_prompt_is_served_from_the_cache(servers):
    on, off = servers
    client, plain = sdk(on), sdk(off)
    first = chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who is Juliet?"}])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second_msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who is Romeo?"}]
    second = chat(client, second_msgs)
    cached = second.usage.prompt_tokens_details.cached_tokens
    with on.client() as c:
        n_system = len(c.post("/tokenize", json={"messages": [{"role": "system", "content": SYSTEM}],
                                                 "add_generation_prompt": False}).json()["tokens"])
    assert n_system - 16 <= cached < second.usage.prompt_tokens  # at least the system prompt's full blocks
    reference = chat(plain, second_msgs)
    assert reference.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message.content == reference.choices[0].message.content


def test_a_conversation_resent_in_full_reuses_its_earlier_turns(servers):
    on, _ = servers
    client = sdk(on)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Speak of the moon."}]
    turn = chat(client, messages)
    messages += [{"role": "assistant", "content": turn.choices[0].message.content},
                 {"role": "user", "content": "And of the sun?"}]
    chunks = chat(client, messages, stream=True)
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens >= turn.usage.prompt_tokens - 16


def test_cache_report_and_counters(servers):
    on, off = servers
    with on.client() as c:
        body = c.get("/v1/cache").json()
        prefix = body["prefix_cache"]
        assert prefix["enabled"] is True and prefix["hit_tokens"] > 0
        assert prefix["queried_tokens"] >= prefix["hit_tokens"] and prefix["cells"] == body["cells"]["cached"] > 0
        assert body["cells"]["used"] + body["cells"]["free"] == body["cells"]["total"]
    assert metric_value(on, "cellserve:prefix_cache_hits_total") == prefix["hit_tokens"]
    assert metric_value(on, "cellserve:prefix_cache_queries_total") == prefix["queried_tokens"]
    with off.client() as c:
        assert c.get("/v1/cache").json()["prefix_cache"]["enabled"] is False
    assert metric_value(off, "cellserve:prefix_cache_hits_total") == 0


def test_the_cli_flag_turns_it_off():
    import argparse

    from server.cli import serve_parser

    parser = serve_parser(argparse.ArgumentParser())
    assert parser.parse_args([]).no_prefix_cache is False
    assert parser.parse_args(["--no-prefix-cache"]).no_prefix_cache is True


def test_clearing_cached_prefixes_frees_their_cells_and_only_theirs(servers):
    on, _ = servers
    client = sdk(on)
    chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who is Hamlet?"}])
    with on.client() as c:
        seq = c.post("/v1/sequences", json={"prompt": SYSTEM}).json()
        before = c.get("/v1/cache").json()
        assert before["cells"]["cached"] > 0
        cleared = c.delete("/v1/cache/prefixes").json()
        assert cleared == {"object": "cache.prefixes.cleared", "freed_cells": cleared["freed_cells"]}
        after = c.get("/v1/cache").json()
        assert after["cells"]["cached"] == 0 and after["prefix_cache"]["cached_sequences"] == 0
        assert 0 < cleared["freed_cells"] <= before["cells"]["cached"]
        assert [s["id"] for s in after["sequences"]] == [seq["id"]]  # a persistent sequence keeps its cells
        assert after["cells"]["used"] == before["cells"]["used"]
        again = chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who is Hamlet?"}])
        assert again.usage.prompt_tokens_details.cached_tokens == 0  # nothing of it was left cached
        assert c.delete(f"/v1/sequences/{seq['id']}").status_code == 200
        c.delete("/v1/cache/prefixes")
    assert on.wait_idle()["cells"]["used"] == 0
