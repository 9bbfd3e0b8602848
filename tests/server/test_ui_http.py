"""The chat page over plain HTTP (no browser): `GET /` and every file it loads are served without the
API key, with the right types and a same-origin-only CSP; only the shipped files are reachable; the
files are package data (an installed wheel has them); `cellserve serve --no-ui` answers `GET /` 404."""

import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import httpx
import pytest
from browser_support import ROOT, ServeProcess
from http_support import API_KEY, LiveServer

from server.ui.routes import STATIC


@pytest.fixture(scope="module")
def keyed(model_dir):
    with LiveServer(model_dir, api_key=API_KEY) as srv:
        yield srv


def referenced_assets(html: str) -> set[str]:
    """The /ui/ files index.html names, plus every module those scripts import (transitively)."""
    found = set(re.findall(r'(?:src|href)="/ui/([\w.-]+)"', html))
    queue = [name for name in found if name.endswith(".js")]
    while queue:
        text = (STATIC / queue.pop()).read_text()
        for name in re.findall(r'from "\./([\w.-]+)"', text):
            if name not in found:
                found.add(name)
                queue.append(name)
    return found


def test_page_and_assets_load_without_the_key(keyed):
    with httpx.Client(base_url=keyed.url, timeout=30) as c:  # no Authorization header
        page = c.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "unsafe-inline" not in csp
        assert '<script type="module" src="/ui/app.js">' in page.text
        assets = referenced_assets(page.text)
        assert {"app.js", "style.css", "markdown.js", "api.js", "tree.js"} <= assets
        for name in assets:
            r = c.get(f"/ui/{name}")
            assert r.status_code == 200, name
            kind = "text/css" if name.endswith(".css") else "text/javascript"
            assert r.headers["content-type"].startswith(kind), name
            assert r.headers["x-content-type-options"] == "nosniff"
            assert r.content == (STATIC / name).read_bytes()
        assert c.head("/").status_code == 200
        assert c.get("/v1/models").status_code == 401  # the data still needs the key


def test_only_the_shipped_files_are_served(keyed):
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        for path in ("/ui/index.html.bak", "/ui/routes.py", "/ui/..%2Froutes.py", "/ui/", "/index.html"):
            r = c.get(path)
            assert r.status_code == 404, path
            assert r.json()["error"]["type"] == "not_found_error"


def test_page_never_puts_the_key_in_a_url():
    for path in STATIC.iterdir():
        text = path.read_text()
        assert "localStorage.setItem(KEY" not in text
        assert not re.search(r"[?&](api_?key|key|token)=", text), path.name


def test_static_files_are_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["server"]
    shipped = [str(p.relative_to(ROOT / "server")) for p in STATIC.iterdir()]
    assert shipped and all(any(fnmatch(name, pat) for pat in patterns) for name in shipped)


def test_no_ui_flag_turns_the_page_off(tmp_path: Path):
    # the socket opens before the model loads: the route table is what is checked, so no wait for the model
    with ServeProcess(["--no-ui", "--n-cells", "256"], tmp_path / "serve.log") as srv:
        srv.wait_listening()
        r = httpx.get(srv.url + "/", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert httpx.get(srv.url + "/ui/app.js", timeout=10).status_code == 404
