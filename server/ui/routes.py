"""The chat page: `GET /` serves `static/index.html`, `GET /ui/{name}` its scripts and stylesheet.

The files hold no data (every conversation comes from the `/v1` API, which the page calls with the
key the user gives it), so these routes need no API key: a browser can load the page before it has
one, and asks for it on the first 401. Only the files shipped in `static/` are served (the names are
listed once, at import; nothing else under the package can be reached), each with a Content-Security-
Policy that allows scripts, styles and requests from this origin only: even if model text ever
reached the DOM as markup, no inline or foreign script could run.
"""

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from server.errors import APIError

STATIC = Path(__file__).resolve().parent / "static"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
FILES = {p.name: p for p in sorted(STATIC.iterdir()) if p.suffix in MEDIA_TYPES and p.name != "index.html"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: an upgraded server never runs an old page
}

router = APIRouter(include_in_schema=False)


def _file(path: Path) -> FileResponse:
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=SECURITY_HEADERS)


@router.get("/")
async def index() -> FileResponse:
    return _file(STATIC / "index.html")


@router.get("/ui/{name}")
async def asset(name: str) -> FileResponse:
    path = FILES.get(name)
    if path is None:
        raise APIError(404, f"the chat page has no file {name!r}; it ships {sorted(FILES)}", code="not_found")
    return _file(path)
