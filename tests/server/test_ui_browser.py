"""The chat page in a real browser (headless Chromium, tests/browser_support.py) against a real `cellserve
serve` on the bundled model, started with `--api-key`: the page asks for the key, streams replies,
regenerates and edits as forks that share cells (checked on /v1/sequences and /v1/cache), deletes
branches and frees their cells, stops a reply mid-stream, renders model text as text, says when a
branch is gone, and works at 400 px. It also writes docs/chat-page.png (two branches), the README's
screenshot."""

import json

import httpx
import pytest
from browser_support import ROOT, ServeProcess, chromium, need_browser, quit_chromium

pytestmark = pytest.mark.browser
KEY = "sk-chat-page-test"
SCREENSHOT = ROOT / "docs" / "chat-page.png"


class Page:
    """The page in one browser tab, and the server it talks to (over HTTP, with the key)."""

    def __init__(self, driver, url: str):
        self.d = driver
        self.url = url
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)

    def wait(self, condition, timeout: float = 30, what: str = ""):
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.d, timeout, poll_frequency=0.05).until(lambda _: condition(), message=what)

    def js(self, script: str, *args):
        return self.d.execute_script(script, *args)

    def css(self, selector: str):
        from selenium.webdriver.common.by import By

        return self.d.find_elements(By.CSS_SELECTOR, selector)

    def one(self, selector: str):
        found = self.css(selector)
        assert len(found) == 1, f"{selector}: {len(found)} elements"
        return found[0]

    def conv(self) -> dict:
        return self.js("const i = JSON.parse(localStorage.getItem('cellserve.chats'));"
                       "return JSON.parse(localStorage.getItem('cellserve.chat.' + i.current));")

    def new_chat(self, **settings) -> None:
        self.one("#new-chat").click()  # a new conversation (or the current one when it is still empty)
        self.wait(lambda: not self.css("#messages .msg"), what="an empty conversation")
        for name, value in settings.items():  # the settings form, as a person would fill it
            self.js("const el = document.getElementById('set-' + arguments[0]); el.value = arguments[1];"
                    "el.dispatchEvent(new Event('input', {bubbles: true}));", name, str(value))

    def idle(self) -> bool:
        return not self.one("#send").get_attribute("disabled") and not self.css('.msg[data-status="streaming"]')

    def send(self, text: str) -> None:
        from selenium.webdriver.common.keys import Keys

        box = self.one("#input")
        box.send_keys(text, Keys.ENTER)
        self.wait(self.idle, what="the reply to finish")

    def click(self, selector: str) -> None:
        self.one(selector).click()
        self.wait(self.idle, what=f"{selector} to finish")

    def shown_replies(self) -> list[str]:
        return [e.text for e in self.css(".msg.assistant .content")]

    def server_seqs(self) -> dict:
        return {s["id"]: s for s in self.http.get("/v1/sequences").raise_for_status().json()["data"]}

    def used_cells(self) -> int:
        return self.http.get("/v1/cache").raise_for_status().json()["cells"]["used"]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    need_browser()
    log = tmp_path_factory.mktemp("chat-page") / "serve.log"
    with ServeProcess(["--api-key", KEY, "--seq-ttl", "3600", "--served-model-name", "bundled-toy-model"], log) as srv:
        driver = chromium()
        try:
            driver.set_script_timeout(30)
            srv.wait_healthy()
            p = Page(driver, srv.url)
            driver.get(srv.url + "/")
            p.wait(lambda: p.one("#key-dialog").get_attribute("open") is not None, what="the key dialog")
            p.asked = p.one("#key-reason").text
            p.one("#key-input").send_keys(KEY)
            p.one("#key-ok").click()
            p.wait(lambda: p.one("#model").text, what="the model name (the key worked)")
            yield p
            p.http.close()
        finally:
            quit_chromium(driver)


def test_page_asks_for_the_key_and_keeps_it_in_session_storage(page):
    assert "API key" in page.asked  # the server's 401 message, shown in the dialog
    assert page.js("return sessionStorage.getItem('cellserve.apiKey')") == KEY
    assert KEY not in page.d.current_url
    assert KEY not in page.js("return JSON.stringify(localStorage)")
    names = [e["message"] for e in page.d.get_log("browser") if e["level"] == "SEVERE"]
    assert all("401" in m for m in names), names  # the one refused call before the key, nothing else


def test_send_streams_the_reply_with_its_numbers(page):
    page.new_chat(max_tokens=96, temperature=0.8)
    box = page.one("#input")
    from selenium.webdriver.common.keys import Keys

    box.send_keys("first line", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "second")  # Shift+Enter: a new line
    assert page.js("return document.getElementById('input').value") == "first line\nsecond"
    assert not page.css("#messages .msg")
    page.js("window.seen = []; new MutationObserver(() => {"
            " const c = document.querySelector('.msg[data-status=\"streaming\"] .content');"
            " if (c) window.seen.push(c.textContent.length); })"
            ".observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});")
    box.send_keys(Keys.ENTER)
    page.wait(page.idle)
    seen = page.js("return window.seen")
    assert len({n for n in seen if n}) >= 2, f"the reply did not arrive in pieces: {seen}"
    [user] = page.css(".msg.user .content")
    assert user.text == "first line\nsecond"
    [reply] = page.shown_replies()
    node = next(n for n in page.conv()["nodes"].values() if n["role"] == "assistant")
    assert reply and node["status"] == "done"
    stats = {e.get_attribute("data-stat"): e.get_attribute("data-value") for e in page.css(".msg.assistant .stat")}
    assert int(stats["prompt"]) == node["start"] > 0 and int(stats["completion"]) == node["end"] - node["start"]
    assert float(stats["ttft"]) >= 0 and float(stats["tps"]) > 0 and stats["cached"] != ""
    assert page.server_seqs()[node["seq"]]["length"] == node["end"]
    page.wait(lambda: int(page.one("#gauge").get_attribute("data-used")) == page.used_cells(), what="the gauge")


def tree_forks(page) -> int:
    return len(page.css("#tree li.fork"))


def test_branches_share_cells_and_deleting_them_frees_cells(page):
    page.new_chat(max_tokens=40, temperature=0.9)
    page.send("Who is Juliet?")
    [first] = page.shown_replies()
    used_one = page.used_cells()

    page.click(".msg.assistant .regenerate")  # fork at the end of the user's message, generate
    assert page.one(".msg.assistant .branch-pos").text == "2 / 2"
    assert tree_forks(page) == 1
    conv = page.conv()
    user = next(n for n in conv["nodes"].values() if n["role"] == "user")
    a, b = (conv["nodes"][i] for i in user["children"])
    second = page.shown_replies()[0]
    seqs = page.server_seqs()
    assert seqs[b["seq"]]["parent"] == a["seq"]  # a fork of the first branch, sharing the user's message
    assert seqs[b["seq"]]["cells"]["shared"] >= user["end"] - 1
    assert b["stats"]["reused"] == user["end"] and b["stats"]["prompt"] == 0  # no prefill of the history
    added = page.used_cells() - used_one
    assert added == seqs[b["seq"]]["cells"]["owned"] - seqs[b["seq"]]["cells"]["shared"]  # only the new reply

    page.click(".msg.assistant .prev")  # both replies are kept
    assert page.shown_replies() == [first]
    page.click(".msg.assistant .next")
    assert page.shown_replies() == [second]
    page.wait(lambda: int(page.one("#gauge").get_attribute("data-used")) == page.used_cells(), what="the gauge")
    page.js("document.querySelectorAll('details').forEach(d => d.open = d.id !== 'settings-panel')")
    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.d.save_screenshot(str(SCREENSHOT))

    page.send("And Romeo?")  # continue the second branch: appended in place (it is its sequence's tip)
    conv = page.conv()
    assert len(conv["seqs"]) == 2
    page.css(".msg.user .edit")[-1].click()
    edit = page.one(".msg.user .edit-input")
    edit.clear()
    edit.send_keys("And Mercutio?")
    page.click(".save-edit")  # edit = fork at the start of the edited message
    assert page.css(".msg.user .branch-pos")[-1].text == "2 / 2"
    conv = page.conv()
    assert len(conv["seqs"]) == 3 and tree_forks(page) == 2
    page.css(".msg.user .edit")[0].click()  # the first message: a new root branch
    edit = page.one(".msg.user .edit-input")
    edit.clear()
    edit.send_keys("Who is Tybalt?")
    page.click(".save-edit")
    assert page.css(".msg.user .branch-pos")[0].text == "2 / 2"
    conv = page.conv()
    assert len(conv["seqs"]) == 4 and tree_forks(page) == 3
    leaves = [n for n in conv["nodes"].values() if not n["children"]]
    assert len(leaves) == 4 and all(page.server_seqs()[n["seq"]]["length"] == n["end"] for n in leaves)

    # delete the regenerated branch (its reply and everything after it): its two sequences go
    page.one(f"#tree button[data-node-id='{b['id']}']").click()
    before = page.used_cells()
    doomed = [s for s in conv["seqs"] if s != a["seq"] and page.server_seqs()[s]["parent"] == a["seq"]]
    doomed += [s for s in conv["seqs"] if page.server_seqs()[s]["parent"] in doomed]
    assert len(doomed) == 2
    page.click(f".msg.assistant[data-node-id='{b['id']}'] .delete")
    seqs = page.server_seqs()
    assert not set(doomed) & set(seqs) and a["seq"] in seqs
    assert page.used_cells() < before
    assert page.one(".msg.assistant .content").text == first and tree_forks(page) == 1

    # delete the first reply too: the user's message still needs its sequence, which is cut back to it
    page.click(".msg.assistant .delete")
    assert page.server_seqs()[a["seq"]]["length"] == user["end"]
    assert page.css(".msg.user .reply")  # a user message with no reply offers one
    page.click(".msg.user .reply")
    assert len(page.shown_replies()) == 1 and page.server_seqs()[a["seq"]]["length"] > user["end"]


def test_stop_cuts_a_long_reply_and_keeps_the_cells_consistent(page):
    page.new_chat(max_tokens=470, temperature=0.8)
    page.d.execute_async_script("""
        const done = arguments[arguments.length - 1];
        const observer = new MutationObserver(() => {
          const c = document.querySelector('.msg[data-status="streaming"] .content');
          if (c && c.textContent.length) { observer.disconnect(); document.getElementById('stop').click(); done(); }
        });
        observer.observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
        document.getElementById('input').value = 'Tell me a long story.';
        document.getElementById('send').click();""")
    page.wait(page.idle, what="the stopped reply to settle")
    [reply] = page.css(".msg.assistant")
    assert reply.get_attribute("data-status") == "stopped"
    node = next(n for n in page.conv()["nodes"].values() if n["role"] == "assistant")
    info = page.server_seqs()[node["seq"]]
    assert info["status"] == "idle" and info["length"] == node["end"]
    assert 0 < node["end"] - node["start"] < 470
    assert not page.one("#stop").is_displayed()


def test_model_text_is_rendered_as_text(page):
    payload = "<script>document.title='owned'</script><img src=x onerror=\"document.title='owned'\"> **bold** `a<b>`"
    # structured output makes the model write exactly this (the schema box of the settings)
    page.new_chat(max_tokens=120, schema=json.dumps({"const": payload}))
    page.send("Say it.")
    [reply] = page.css(".msg.assistant .content")
    assert "<script>document.title='owned'</script>" in reply.text and "<img src=x" in reply.text
    assert not page.css("#messages script, #messages img")
    assert [e.text for e in page.css(".msg.assistant .content strong")] == ["bold"]
    assert [e.text for e in page.css(".msg.assistant .content code")] == ["a<b>"]
    assert page.d.title != "owned"
    html = page.d.execute_async_script("""
        const done = arguments[arguments.length - 1];
        import('/ui/markdown.js').then(m => done(m.renderMarkdown(arguments[0])));""",
        "```html\n<script>x()</script>\n```\n- <b onclick=y()>item</b>\n1. **<i>n</i>**\n\"quoted\" & 'single'")
    assert "<script" not in html and "<b " not in html and "<i>" not in html
    assert html == ('<pre><code class="language-html">&lt;script&gt;x()&lt;/script&gt;</code></pre>'
                    '<ul><li>&lt;b onclick=y()&gt;item&lt;/b&gt;</li></ul>'
                    '<ol><li><strong>&lt;i&gt;n&lt;/i&gt;</strong></li></ol>'
                    '<p>&quot;quoted&quot; &amp; &#39;single&#39;</p>')


def test_a_branch_gone_from_the_server_is_shown_as_gone(page):
    page.new_chat(max_tokens=8)
    page.send("Hello?")
    seq = next(n for n in page.conv()["nodes"].values() if n["role"] == "assistant")["seq"]
    page.http.delete(f"/v1/sequences/{seq}").raise_for_status()  # as a restart without durable sequences would
    page.d.refresh()
    page.wait(lambda: page.css(".badge.gone"), what="the gone badge")
    assert "gone" in page.one("#notice").text
    assert page.one("#send").get_attribute("disabled")
    assert page.one(".msg.assistant .regenerate").get_attribute("disabled")


def test_usable_at_400_px_with_labelled_controls(page):
    # the viewport itself (a headless window cannot be made narrower than 500 px)
    page.d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 400, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    try:
        page.d.refresh()
        page.wait(lambda: page.one("#model").text)
        assert page.js("return window.innerWidth") == 400
        page.new_chat(max_tokens=16)
        width = page.js("return document.documentElement.scrollWidth")
        assert width <= 400, f"the page scrolls sideways at 400 px ({width} px wide)"
        for selector in ("#input", "#send"):
            box = page.one(selector).rect
            assert box["x"] >= 0 and box["x"] + box["width"] <= 400, selector
        unlabelled = page.js("return [...document.querySelectorAll('input, textarea, select, button')]"
                             ".filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')"
                             " && !e.textContent.trim()).map(e => e.outerHTML)")
        assert not unlabelled
        page.send("Small screen?")
        assert page.shown_replies()
    finally:
        page.d.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_a_follow_up_continues_the_chat_template(page):
    """A follow-up is appended as the template continues a conversation (end of turn, the message, the
    generation prompt), not as a new conversation's start (no second BOS or default system prompt)."""
    from transformers import AutoTokenizer

    page.new_chat(max_tokens=16, schema=json.dumps({"const": "Juliet"}))  # a fixed reply that ends with EOS
    page.send("Who is she?")
    page.send("And Romeo?")
    conv = page.conv()
    nodes = conv["nodes"]
    path, node = [], nodes["root"]
    while node["children"]:
        node = nodes[node["children"][node["selected"]]]
        path.append(node)
    assert [n["role"] for n in path] == ["user", "assistant", "user", "assistant"]
    assert path[1]["text"] == '"Juliet"' and path[1]["stats"]["finish"] == "stop"
    assert len(conv["seqs"]) == 1  # continued in place
    ids = page.http.get(f"/v1/sequences/{path[3]['seq']}").json()["token_ids"]
    text = page.http.post("/detokenize", json={"tokens": ids[:path[2]["end"]]}).json()["prompt"]
    tok = AutoTokenizer.from_pretrained(ROOT / "engine" / "loader" / "default" / "model")
    messages = [{"role": n["role"], "content": n["text"]} for n in path[:3]]
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # the reply's own EOS stays in the sequence as the model wrote it (this template writes none there)
    assert text == expected.replace('"Juliet"', '"Juliet"' + tok.eos_token, 1)
