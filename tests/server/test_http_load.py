"""Many concurrent streams through one server, and /metrics under that load."""

import asyncio

import pytest
from http_support import LiveServer, metric_value, sse_events
from prometheus_client.parser import text_string_to_metric_families

PROMPTS = ["ROMEO: But soft", "JULIET: O Romeo", "The quick brown fox", "Naïve café 日本語"]
N_STREAMS = 64
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def srv(model_dir):
    with LiveServer(model_dir, n_cells=4096, max_num_batched_tokens=256) as server:
        yield server


def test_64_concurrent_streams_all_complete_correctly(srv):
    with srv.client() as c:
        want = {p: c.post("/v1/completions", json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0})
                .json()["choices"][0]["text"] for p in PROMPTS}
    baseline = srv.cache()["cells"]["used"]

    async def one(client, prompt: str, chat: bool) -> tuple[str, list]:
        if chat:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "stream": True,
                    "temperature": 0}
            path = "/v1/chat/completions"
        else:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0,
                    "stream_options": {"include_usage": True}}
            path = "/v1/completions"
        async with client.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200
            return prompt, sse_events([line async for line in resp.aiter_lines()])

    async def main():
        async with srv.async_client() as client:
            jobs = [one(client, PROMPTS[i % len(PROMPTS)], chat=i % 8 == 7) for i in range(N_STREAMS)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    assert len(results) == N_STREAMS
    for prompt, events in results:
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        if chunks[0]["object"] == "chat.completion.chunk":
            assert sum(1 for e in chunks if e["choices"][0]["finish_reason"]) == 1
            continue
        assert "".join(e["choices"][0]["text"] for e in chunks) == want[prompt]
        assert events[-2]["usage"]["completion_tokens"] == MAX_TOKENS
    assert srv.wait_cells_used(baseline, timeout=10) == baseline


def test_metrics_parse_and_move(srv):
    with srv.client() as c:
        text = c.get("/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("cellserve:num_requests_running", "cellserve:num_requests_waiting", "cellserve:cells_used",
                     "cellserve:cells_free", "cellserve:num_preemptions", "cellserve:prompt_tokens",
                     "cellserve:generation_tokens", "cellserve:time_to_first_token_seconds",
                     "cellserve:inter_token_latency_seconds", "cellserve:e2e_request_latency_seconds"):
            assert name in families, name
        total = metric_value(srv, "cellserve:cells_total")
        assert metric_value(srv, "cellserve:cells_used") + metric_value(srv, "cellserve:cells_free") == total
        before = {n: metric_value(srv, n) for n in (
            "cellserve:generation_tokens_total", "cellserve:prompt_tokens_total",
            "cellserve:time_to_first_token_seconds_count", "cellserve:e2e_request_latency_seconds_count",
            "cellserve:inter_token_latency_seconds_count")}
        stop_before = metric_value(srv, "cellserve:request_success_total", finished_reason="length")
        errors_before = metric_value(srv, "cellserve:request_errors_total", status="400")
        assert c.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 5, "ignore_eos": True,
                                               "stream": True}).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
    srv.wait_idle()
    after = {n: metric_value(srv, n) for n in before}
    assert after["cellserve:generation_tokens_total"] >= before["cellserve:generation_tokens_total"] + 5
    assert after["cellserve:prompt_tokens_total"] > before["cellserve:prompt_tokens_total"]
    assert after["cellserve:time_to_first_token_seconds_count"] == before["cellserve:time_to_first_token_seconds_count"] + 1
    assert after["cellserve:e2e_request_latency_seconds_count"] == before["cellserve:e2e_request_latency_seconds_count"] + 1
    assert after["cellserve:inter_token_latency_seconds_count"] >= before["cellserve:inter_token_latency_seconds_count"] + 4
    assert metric_value(srv, "cellserve:request_success_total", finished_reason="length") == stop_before + 1
    assert metric_value(srv, "cellserve:request_errors_total", status="400") == errors_before + 1
