"""CORS from a real browser: a page on another origin (headless Chromium, tests/browser_support.py) calls a
server started with `--cors-origins` for that origin: the preflight for an `Authorization` header passes, a
streamed chat arrives chunk by chunk and its `X-Request-Id` is readable; the same page from an origin not
listed is refused by the browser itself."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from browser_support import chromium, need_browser, quit_chromium
from http_support import API_KEY, LiveServer

pytestmark = pytest.mark.browser

SCRIPT = """
const [url, key, done] = [arguments[0], arguments[1], arguments[arguments.length - 1]];
(async () => {
  try {
    const r = await fetch(url + '/chat/completions', {method: 'POST',
      headers: {'Authorization': 'Bearer ' + key, 'Content-Type': 'application/json'},
      body: JSON.stringify({model: 'm', messages: [{role: 'user', content: 'hi'}], max_tokens: 6,
                            temperature: 0, stream: true})});
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let text = '';
    for (;;) { const {value, done: end} = await reader.read(); if (end) break; text += dec.decode(value); }
    done({status: r.status, requestId: r.headers.get('X-Request-Id'), body: text});
  } catch (e) { done({error: String(e)}); }
})();
"""


class Page(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"<!doctype html><title>front-end</title><p>another origin</p>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def page_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_page_on_another_origin_streams_through_cors(model_dir, page_server):
    need_browser()
    allowed = f"http://127.0.0.1:{page_server}"
    with LiveServer(model_dir, api_key=API_KEY, cors_origins=[allowed]) as srv:
        driver = chromium()
        try:
            driver.set_script_timeout(60)
            driver.get(allowed + "/")
            got = driver.execute_async_script(SCRIPT, srv.url, API_KEY)
            assert got.get("status") == 200, got
            assert got["requestId"].startswith("chatcmpl-")
            chunks = [line for line in got["body"].split("\n") if line.startswith("data: ")]
            assert chunks[-1] == "data: [DONE]" and len(chunks) >= 3
            driver.get(f"http://localhost:{page_server}/")  # another origin: not listed
            refused = driver.execute_async_script(SCRIPT, srv.url, API_KEY)
            assert "error" in refused and "Failed to fetch" in refused["error"], refused
        finally:
            quit_chromium(driver)
