"""Schema fuzzing (issue #16): schemathesis generates requests from the server's own OpenAPI document,
valid and invalid (its coverage phase: boundary values, wrong types, missing fields, unexpected
methods; then a derandomized fuzzing phase), for every operation, and sends them to a live server
(a real AsyncEngine over the tiny model, real uvicorn on 127.0.0.1).

Guarantees, for every generated request:
- no 5xx (`not_a_server_error`): whatever the body, path or method, the server answers 2xx or 4xx;
- every status is one the schema documents (`status_code_conformance`: the error statuses of
  `server.errors.ERROR_RESPONSES`, never an undocumented 422);
- where the schema documents the status, the response's content type and body match it
  (`content_type_conformance`, `response_schema_conformance`): JSON where JSON is documented, SSE
  (`text/event-stream`) from the generation routes, Prometheus text from /metrics;
- the engine loop never dies (the app's fatal hook is never called).
And the fuzzed document is the one the live server serves.

Bounded: the coverage cases are deterministic, the fuzzing phase is MAX_EXAMPLES per operation and
derandomized, no example database is kept. The pool is 64 cells, so a generation the server admits is
at most ~60 tokens of the tiny model (a chat without max_tokens generates until the pool is full), and
anything larger is a quick 400. About 40 s of CPU on the whole.
"""

import hypothesis
import pytest
import schemathesis
from http_support import LiveServer
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from server.app import build_app

MAX_EXAMPLES = 15
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
GENERATION_ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/sequences/{seq_id}/completions"]


def app_schema() -> dict:
    """The OpenAPI document `build_app` serves (no engine is built or started to get it)."""
    return build_app(lambda: None).openapi()


CONFIG = schemathesis.Config.from_dict({"generation": {"deterministic": True, "database": "none"}})
schema = schemathesis.openapi.from_dict(app_schema(), config=CONFIG)


@pytest.fixture(scope="module")
def fuzz_server(model_dir):
    with LiveServer(model_dir, n_cells=64) as srv:
        yield srv


@schema.parametrize()
@hypothesis.settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)
def test_fuzz_schema(case, fuzz_server):
    """One generated request: no 5xx, the documented content type and body, the engine alive."""
    case.call_and_validate(base_url=fuzz_server.url, checks=CHECKS, timeout=60)
    assert not fuzz_server.fatal, fuzz_server.fatal


def test_live_schema_is_the_fuzzed_one(fuzz_server):
    """The live server serves the document the cases above were generated from."""
    with fuzz_server.client() as c:
        assert c.get("/openapi.json").json() == app_schema()


def test_streamed_and_text_responses_are_documented(fuzz_server):
    """Regression (found by the fuzzing): the generation routes document their SSE answer and /metrics
    its Prometheus text, and the server sends exactly those content types."""
    paths = app_schema()["paths"]
    for route in GENERATION_ROUTES:
        content = paths[route]["post"]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(content), route
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    with fuzz_server.client() as c:
        body = {"prompt": "x", "max_tokens": 2, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
        assert c.get("/metrics").headers["content-type"].startswith("text/plain")
