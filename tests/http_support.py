"""A real cellserve HTTP server for tests: a real AsyncEngine over a tiny seeded model, served by uvicorn
on 127.0.0.1 (a socket bound to a free port before the server starts, so there is no port race).

The server runs in a background thread with its own event loop; tests talk to it only over HTTP
(httpx, the `openai` SDK), exactly as a remote client would. Nothing is mocked.
"""

import socket
import threading
import time
from typing import Self

import httpx
import uvicorn

from engine.core.async_engine import AsyncEngine
from server.app import build_app
from server.config import KEEP_ALIVE_S
from server.http_edge import uvicorn_options

MODEL_NAME = "tiny-llama"
API_KEY = "sk-test-key"


ORPHANS: list[str] = []  # what `LiveServer.orphan_check` found as servers exited (tests/server/conftest.py fails on it)
LONG_TOKENS = 4000  # with `long_model_dir`: far more ticks than any mid-stream action needs


class Greedy:
    """From-scratch greedy completions with the offline `LLM` (the reference the server must match)."""

    def __init__(self, model_dir: str):
        from engine.core.llm import LLM

        self.llm = LLM(model=model_dir, dtype="float32", n_cells=2048)  # the servers' dtype (LiveServer, ServerProcess)
        self.tokenizer = self.llm.tokenizer

    def __call__(self, prompt_ids: list[int], max_tokens: int, **kw):
        from engine.api.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
        return self.llm.generate([list(prompt_ids)], params, use_tqdm=False)[0].outputs[0]


class LiveServer:
    """`with LiveServer(model_dir, n_cells=...) as srv:` -> srv.url, srv.client(), srv.cache()."""

    def __init__(self, model_dir: str, *, api_key: str | None = None, grace_s: float = 2.0, factory=None,
                 limits=None, cors_origins=None, pooling=None, rerank_mode="cosine",
                 **engine_kw):
        """`factory`: build the engine lazily through it instead (the app loads it in the background).
        `limits`: a `server.limits.Limits` (request limits), else the defaults. `cors_origins`, `pooling`,
        `rerank_mode`: as --cors-origins, --pooling, --rerank-mode."""
        engine_kw.setdefault("n_cells", 2048)
        # float32, as the references (Greedy, the cacheless oracles) run: `auto` would be bf16 on CPUs with
        # AVX512-BF16, whose rounding can turn a near-tie of the tiny model's logits (tests/engine/api/test_cpu.py
        # checks auto against the oracle within bf16's tolerance)
        engine_kw.setdefault("dtype", "float32")
        self.engine = None if factory else AsyncEngine.from_pretrained(model_dir, **engine_kw)
        self.fatal: list[str] = []
        self.state_dir = engine_kw.get("state_dir")
        self.app = build_app(factory or self.engine, served_model_name=MODEL_NAME, api_key=api_key,
                             shutdown_grace_s=grace_s, limits=limits, on_fatal=self.fatal.append,
                             state_dir=engine_kw.get("state_dir"), cors_origins=cors_origins, pooling=pooling,
                             rerank_mode=rerank_mode)
        self.ctx = self.app.state.ctx
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S,
                                timeout_graceful_shutdown=int(grace_s) + 1,
                                **uvicorn_options(self.ctx.limits, self.ctx.metrics.count_edge_refusal))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start; see the log above")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        found = self.orphan_check()
        if found is not None:
            ORPHANS.append(found)
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def orphan_check(self, timeout: float = 10.0) -> str | None:
        """Once the server is idle (no request running or waiting, no run registered, every Responses turn
        settled), the pool holds only what live sequences and cached prefixes own: every stored tip is its
        sequence's whole length, and deleting every sequence and dropping every cached prefix frees every
        cell. None when so, else what was left. Destructive: it runs as the server exits (with a state dir only
        the checks before the deletes: its sequences are kept for the next server on the folder). A server
        that is not serving (failed, draining, stopped by its test) has no pool to check."""
        if self.ctx.state != "ready" or not self.thread.is_alive():
            return None
        store = getattr(self.app.state, "response_store", None)
        deadline = time.monotonic() + timeout
        try:
            with self.client() as c:
                while True:
                    body = c.get("/v1/cache").raise_for_status().json()
                    busy = body["requests"]["running"] or body["requests"]["waiting"] or self.ctx.runs \
                        or (store is not None and store.busy)
                    if not busy or time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
                if busy:
                    return (f"{self.url}: not idle after {timeout}s: requests {body['requests']}, runs "
                            f"{sorted(self.ctx.runs)}, turns holding {dict(store.busy) if store else {}}")
                seqs = {q["id"]: q for q in c.get("/v1/sequences").raise_for_status().json()["data"]}
                if store is not None:
                    long = {sid: (seqs[sid]["length"], store.by_id[tip].length) for sid, tip in store.tips.items()
                            if tip in store.by_id and sid in seqs and seqs[sid]["length"] != store.by_id[tip].length}
                    if long:
                        return f"{self.url}: stored tips shorter than their sequences ((sequence, tip) lengths): {long}"
                if self.state_dir is not None:
                    return None
                for sid in seqs:
                    c.delete(f"/v1/sequences/{sid}").raise_for_status()
                c.delete("/v1/cache/prefixes").raise_for_status()
                cells = c.get("/v1/cache").raise_for_status().json()["cells"]
        except httpx.HTTPError:
            return None  # the test stopped or broke its server; nothing to check
        if cells["used"] or cells["cached"]:
            return (f"{self.url}: {cells['used'] + cells['cached']} cells still used after deleting every "
                    f"sequence ({len(seqs)}) and cached prefix: owned by nothing live")
        return None

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60, **kw)

    def async_client(self, **kw) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=60, **kw)

    def cache(self) -> dict:
        with self.client() as c:
            return c.get("/v1/cache").raise_for_status().json()

    def wait_cells_used(self, expected: int, timeout: float = 1.0) -> int:
        """Poll /v1/cache until `cells.used == expected` (or the timeout); return the last value."""
        deadline = time.monotonic() + timeout
        used = self.cache()["cells"]["used"]
        while used != expected and time.monotonic() < deadline:
            time.sleep(0.02)
            used = self.cache()["cells"]["used"]
        return used

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Poll until nothing runs or waits; return the last /v1/cache body."""
        deadline = time.monotonic() + timeout
        body = self.cache()
        while (body["requests"]["running"] or body["requests"]["waiting"]) and time.monotonic() < deadline:
            time.sleep(0.02)
            body = self.cache()
        return body


def sse_events(lines) -> list:
    """Parse `data: ...` lines of an SSE body into JSON objects (and the string '[DONE]')."""
    import json

    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric_value(srv: LiveServer, name: str, **labels) -> float:
    """One sample of /metrics, parsed with prometheus_client's own text parser (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    with srv.client() as c:
        text = c.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
