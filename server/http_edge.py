"""The HTTP edge: what happens to a request before the app sees it, and to a connection after the app
refused one.

uvicorn's httptools protocol (the fast C parser it picks by default) has no limit on the request head
and answers what it cannot parse with a plain-text `Invalid HTTP request received.`; and when the app
answers 413 while the client is still sending, the socket is closed with unread bytes in it, so the
kernel resets the connection and the client may see `ConnectionResetError` instead of the 413. This
module's `EdgeProtocol` is a thin subclass of it (`uvicorn_options` hands it to `uvicorn.Config`) that:

- limits the request head (`server.limits.Limits.max_header_bytes`, `--max-header-bytes`; 64 KiB):
  a URL longer than a header line's limit (`Limits.header_line_bytes`, 8 KiB) is 414, one header line
  over it or a whole head over the total is 431; the bytes buffered for an unfinished head are bounded
  too (at most the total plus one socket read), so a head that never ends cannot grow memory;
- answers what the parser refuses in the API's error shape (`server.errors.error_body`, JSON): an
  unknown method (`BREW /`) is 501, a malformed request line or header is 400;
- closes after a refusal the way nginx does (lingering close): the answer is written, the sending side
  is shut (FIN), then whatever the client still sends is read and thrown away, unparsed, until it
  closes, `LINGER_MAX_BYTES` have been read or `LINGER_S` have passed, whichever comes first. This
  applies to the refusals above and to any response that closes a connection whose request body has
  not been read to the end (the app's 413 `body_too_large`, `server.middleware.BodySizeLimit`), so the
  client reads the answer. A client that sent `Expect: 100-continue` gets the 413 before any body
  (uvicorn sends `100 Continue` only when the app reads the body, which a refused request never does).

Everything else (keep-alive, pipelining, flow control, the request/response cycle) is uvicorn's own.
Without httptools installed uvicorn parses with h11: there only `h11_max_incomplete_event_size` bounds
the head, and its refusals stay plain-text 400s.
"""

import asyncio
import json
import logging
import re
from collections.abc import Callable
from typing import Any

from server.errors import error_body
from server.limits import LINGER_MAX_BYTES, LINGER_S, Limits

log = logging.getLogger("uvicorn.error")

try:
    import httptools
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # uvicorn without its 'standard' extra: the h11 fallback in uvicorn_options
    httptools = None
    HttpToolsProtocol = object  # type: ignore[assignment,misc]

_METHOD_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+ ")  # RFC 9110 token, then the request line's space


class _Refused(Exception):
    """Raised inside a parser callback: the request is answered with this status and message."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class _EdgeTransport:
    """The connection's transport as uvicorn's protocol and request cycles see it: a close asked for
    while the request body is still arriving becomes a lingering close (`EdgeProtocol._close`)."""

    def __init__(self, transport: asyncio.Transport, protocol: "EdgeProtocol"):
        self._transport, self._protocol = transport, protocol
        # the hot path goes straight to the real transport
        self.write, self.get_extra_info = transport.write, transport.get_extra_info
        self.pause_reading, self.resume_reading = transport.pause_reading, transport.resume_reading

    def close(self) -> None:
        self._protocol._close()

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class EdgeProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's httptools protocol with head limits, JSON refusals and lingering close (module doc)."""

    limits: Limits = Limits()  # set per server by `uvicorn_options`
    on_refusal: Callable[[int], None] | None = None  # told each refusal's status (the server's metrics)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._line_max, self._head_max = self.limits.header_line_bytes, self.limits.max_header_bytes
        self._raw: asyncio.Transport | None = None
        self._in_head = False  # between the first byte of a request and the end of its headers
        self._head_fed = 0  # bytes fed while in the head, after the read that began it
        self._header_bytes = 0  # header lines seen so far, with their ': ' and CRLF
        self._body_pending = False  # headers complete, message not complete: the client may still send
        self._lingering = False
        self._linger_left = 0
        self._linger_timer: asyncio.TimerHandle | None = None
        self._lost = False

    # --- the connection ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw = transport
        super().connection_made(_EdgeTransport(transport, self))  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        self._lost = True  # the server is stopping: close at once, never linger
        super().shutdown()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._linger_left -= len(data)
            if self._linger_left <= 0:
                self._raw.close()
            return
        self._unset_keepalive_if_required()
        began_earlier = self._in_head
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # as uvicorn: WebSocket, or a warning and nothing
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            self._refuse(_refusal(exc, data))
            return
        if began_earlier and self._in_head:
            self._head_fed += len(data)
            if self._head_fed > self._head_max:
                self._refuse(self._head_too_large())

    # --- parser callbacks -------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_fed, self._header_bytes, self._body_pending = True, 0, 0, False

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self._line_max:
            raise _Refused(414, f"request URL is too long (over {self._line_max} bytes; at most {self._line_max} "
                           "are accepted, see --max-header-bytes); send parameters in a JSON body", "uri_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:  # per header of every request: kept lean
        line = len(name) + len(value) + 4
        self._header_bytes += line
        if line > self._line_max or self._header_bytes > self._head_max:
            raise self._header_refusal(name, line)
        # uvicorn's HttpToolsProtocol.on_header, inlined: one Python frame per header, not two
        name = name.lower()
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head, self._body_pending = False, True
        if self._header_bytes + len(self.url) > self._head_max:
            raise self._head_too_large()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._body_pending = False
        super().on_message_complete()

    # --- refusals and lingering close --------------------------------------------------------------
    def _header_refusal(self, name: bytes, line: int) -> _Refused:
        if line <= self._line_max:
            return self._head_too_large()
        return _Refused(431, f"request header {name[:64].decode('latin-1')!r} is too long ({line} bytes; at most "
                        f"{self._line_max} a line are accepted, see --max-header-bytes)", "header_too_large")

    def _head_too_large(self) -> _Refused:
        return _Refused(431, f"request headers too large: at most {self.limits.max_header_bytes} bytes of request "
                        "line and headers are accepted (--max-header-bytes)", "header_too_large")

    def send_400_response(self, msg: str) -> None:  # uvicorn's own callers (none left here) get JSON too
        self._refuse(_Refused(400, msg, "invalid_http_request"))

    def _refuse(self, refusal: _Refused) -> None:
        """Answer before the app: JSON error, `Connection: close`, then the lingering close."""
        log.info("refused before the app: %d %s", refusal.status, refusal.message)  # as a 4xx, not a fault
        if self.on_refusal is not None:
            self.on_refusal(refusal.status)
        if self._raw is None or self._raw.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if self._in_head or cycle.response_started:  # a pipelined head behind a running request: close
                self._raw.close()
                return
            # a bad body (chunk framing) under a running request: the app sees a disconnect, its writes drop
            cycle.response_complete = cycle.disconnected = True
            cycle.message_event.set()
        body = json.dumps(error_body(refusal.status, refusal.message, code=refusal.code)).encode()
        head = [STATUS_LINE[refusal.status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        self._raw.write(b"".join(head) + body)
        self._linger()

    def _close(self) -> None:
        """A close asked for by uvicorn (a response with `Connection: close`, a timeout, a lost peer)."""
        if self._body_pending and not self._lingering and not self._lost:
            self._linger()
        else:
            self._raw.close()

    def _linger(self) -> None:
        """Stop parsing; shut our sending side once the answer is out, read and drop what still comes,
        close on the client's EOF, after LINGER_MAX_BYTES or after LINGER_S."""
        self._lingering = True
        self._linger_left = LINGER_MAX_BYTES
        raw = self._raw
        if raw.can_write_eof():
            raw.write_eof()
        raw.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_S, raw.close)


def _refusal(exc: Exception, data: bytes) -> _Refused:
    """What the parser's error means for the client."""
    cause = exc.__context__
    if isinstance(cause, _Refused):
        return cause
    if httptools is not None and isinstance(exc, httptools.HttpParserInvalidMethodError):
        if _METHOD_TOKEN.match(data.lstrip(b"\r\n")):
            return _Refused(501, f"unknown HTTP method {data.split(b' ', 1)[0][:32].decode('latin-1')!r}; this "
                            "server answers GET, HEAD, POST, DELETE and OPTIONS", "method_not_implemented")
        return _Refused(400, "malformed HTTP request line; send 'METHOD /path HTTP/1.1'", "invalid_http_request")
    reason = str(exc) or type(exc).__name__
    return _Refused(400, f"malformed HTTP request ({reason})", "invalid_http_request")


def uvicorn_options(limits: Limits, on_refusal: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The `uvicorn.Config` keywords that put this edge in front of the app (`server.cli.run_server`);
    `on_refusal(status)` is called for each request the edge refuses (the app never sees those)."""
    if httptools is None:
        return {"http": "h11", "h11_max_incomplete_event_size": limits.max_header_bytes}
    protocol = type("EdgeProtocol", (EdgeProtocol,), {"limits": limits, "on_refusal": staticmethod(on_refusal)})
    return {"http": protocol}
