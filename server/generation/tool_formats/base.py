"""The one interface of every tool-call format: a `ToolParser` that splits a model's text into content
and tool calls, whole or streamed, in OpenAI's streaming shape.

`feed(text)` -> (content delta, tool-call deltas); `close()` the same for what was held back. A call's
first delta carries `index`, `id`, `type` and `function.name` with `"arguments": ""`; later deltas carry
argument fragments as they are generated. Guarantees (every format):
- markup never reaches the content: start/end markers, separators between calls (whitespace, `;`, `,`),
  and a call (or a marker prefix) cut by max_tokens are dropped; text held back because it could start a
  marker is sent as soon as it cannot;
- whole and streamed parsing agree: `parse(text)` is one `feed` + `close`, so any split gives the same
  content and calls, and the streamed argument fragments concatenate to the whole call's `arguments`;
- a closed block that is not a call (no function name) stays in the content as the text it was;
- `parallel=False` keeps only the first call; `forced=True` (tool_choice required/named: the grammar
  allows only calls) sends no content at all.
"""

import json
import uuid


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class Call:
    """One call as it streams: a header once its name is known, then argument fragments."""

    def __init__(self, index: int, muted: bool):
        self.index, self.muted = index, muted  # muted: a call beyond the first with parallel=False
        self.id = new_call_id()
        self.name: str | None = None
        self.arguments = ""
        self.done = False

    def whole(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser:
    """Marker-driven splitting shared by the formats. A format sets `starts` (markers that open a call
    block: `(marker, keep)`, keep meaning the marker is part of the block's text), `strip` (markup
    removed wherever it appears), `seps` (characters between calls that are not content) and
    `open_block(marker)` (a `Block` that consumes the block's text)."""

    starts: tuple[tuple[str, bool], ...] = ()
    strip: tuple[str, ...] = ()
    seps = " \t\r\n"

    def __init__(self, tools: list | None = None, *, parallel: bool = True, forced: bool = False):
        self.tools = {t.function.name: t for t in tools or ()}
        self.parallel, self.forced = parallel, forced
        self.pending = ""  # text not yet classified (outside a block)
        self.block: Block | None = None
        self.all_calls: list[Call] = []
        self.held = ""  # trailing separator characters of the content, sent only if more content follows
        self.content = ""
        self._content_out = ""
        self._deltas: list[dict] = []

    # --- what the formats' blocks call
    def begin_call(self, name: str) -> Call:
        kept = [c for c in self.all_calls if not c.muted]
        call = Call(len(kept), muted=not self.parallel and bool(kept))
        call.name = name
        self.all_calls.append(call)
        if not call.muted:
            self._deltas.append({"index": call.index, "id": call.id, "type": "function",
                                 "function": {"name": name, "arguments": ""}})
        return call

    def add_arguments(self, call: Call, fragment: str) -> None:
        if not fragment:
            return
        call.arguments += fragment
        if not call.muted:
            self._deltas.append({"index": call.index, "function": {"arguments": fragment}})

    # --- the public interface
    @property
    def calls(self) -> list[dict]:
        """Every (unmuted) call so far, whole."""
        return [c.whole() for c in self.all_calls if not c.muted]

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        while self.pending:
            if self.block is not None:
                rest = self.block.feed(self.pending)
                if rest is None:
                    self.pending = ""
                    break
                self._end_block()
                self.pending = rest
                continue
            at, marker, keep = self._find_marker(self.pending)
            if marker is None:
                hold = self._partial_marker(self.pending)
                self._add_content(self.pending[: len(self.pending) - hold])
                self.pending = self.pending[len(self.pending) - hold:]
                break
            self._add_content(self.pending[:at])
            rest = self.pending[at + (0 if keep else len(marker)):]
            self.pending = rest
            if keep is not None:
                self.block = self.open_block(marker)
                self._block_marker = "" if keep else marker
        return self._take()

    def close(self) -> tuple[str, list[dict]]:
        if self.block is not None:
            self.block.close()
            self.block = None  # a block cut short: a started call stays as it is, anything else is dropped
        elif self.pending and (len(self.pending) < 2 or not self._partial_marker(self.pending)):
            self._add_content(self.pending)
        self.pending = ""
        if not any(not c.muted for c in self.all_calls) and not self.forced:
            self._content_out += self.held
            self.content += self.held
        self.held = ""
        return self._take()

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """Whole text -> (content, or None when it is only calls and markup; calls)."""
        self.feed(text)
        self.close()
        calls, content = self.calls, self.content
        if calls and not content.strip():
            return None, calls
        return (content.strip() if calls else content), calls

    # --- internals
    def open_block(self, marker: str) -> "Block":
        raise NotImplementedError

    def _end_block(self) -> None:
        block, self.block = self.block, None
        if block.call is None:  # not a call: the block's text is content, as it was written
            self._add_content(self._block_marker + block.text + block.end_text)

    def _find_marker(self, text: str) -> tuple[int, str | None, bool | None]:
        best = (len(text) + 1, None, None)
        for marker, keep in self.starts:
            i = text.find(marker)
            if 0 <= i < best[0]:
                best = (i, marker, keep)
        for marker in self.strip:
            i = text.find(marker)
            if 0 <= i < best[0]:
                best = (i, marker, None)
        return best

    def _partial_marker(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a marker."""
        markers = [m for m, _ in self.starts] + list(self.strip)
        for n in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
            if any(m.startswith(text[-n:]) for m in markers):
                return n
        return 0

    def _add_content(self, text: str) -> None:
        if not text or self.forced:
            return
        buf = self.held + text
        kept = buf.rstrip(self.seps)
        self.held = buf[len(kept):]
        self._content_out += kept
        self.content += kept

    def _take(self) -> tuple[str, list[dict]]:
        out, deltas = self._content_out, self._deltas
        self._content_out, self._deltas = "", []
        return out, deltas


class Block:
    """The text of one call block: `feed(text)` returns None while the block goes on, or the text after
    its end. `call` is the Call it started (None: not a call); `text`/`end_text` what it consumed."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.call: Call | None = None
        self.text = ""
        self.end_text = ""

    def feed(self, text: str) -> str | None:
        raise NotImplementedError

    def close(self) -> None:
        """The output ended inside the block."""
        if self.call is not None:
            self.call.done = True


class JsonCall:
    """Scans one JSON object `{"name": ..., "arguments"|"parameters": {...}}` as it arrives (strings and
    nesting tracked char by char, each char once) and streams it as a call: the header as soon as the
    top-level name is complete, then the raw text of the arguments value as it is generated (trailing
    whitespace held back until the value goes on). Arguments given as a JSON string are sent decoded,
    once complete. `end` is the index just past the object once it closed."""

    ARG_KEYS = ("arguments", "parameters")

    def __init__(self, block: Block):
        self.block = block
        self.buf = ""
        self.i = 0
        self.depth = 0
        self.in_str = self.esc = False
        self.str_start = 0
        self.state = "start"  # start | key | colon | value
        self.key: str | None = None
        self.fields: dict[str, list] = {}
        self.end: int | None = None
        self.sent = 0

    def feed(self, text: str) -> int | None:
        """Add text; return the index in `text` just past the object when it closed in it."""
        base = len(self.buf)
        if self.end is not None:
            return None
        self.buf += text
        self._scan()
        self._stream()
        return None if self.end is None else self.end - base

    def _scan(self) -> None:
        buf, f = self.buf, self.fields
        while self.i < len(buf) and self.end is None:
            i, c = self.i, buf[self.i]
            self.i += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if self.depth == 1 and self.state == "key":
                        try:
                            self.key = json.loads(buf[self.str_start:i + 1])
                        except ValueError:
                            self.key = None
                        self.state = "colon"
                continue
            if self.depth == 0:
                if c == "{":
                    self.depth, self.state = 1, "key"
                elif not c.isspace():
                    self.end = i  # not an object: nothing to scan
                continue
            value = self.depth == 1 and self.state == "value"
            if value and self.key in f and f[self.key][0] is None and not c.isspace() and c not in ",}":
                f[self.key][0] = i
            if c == '"':
                self.in_str, self.str_start = True, i
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    if self.state == "value" and self.key in f:
                        f[self.key][1] = i
                    self.end = i + 1
            elif self.depth == 1 and c == ":" and self.state == "colon":
                self.state = "value"
                if self.key is not None:
                    f[self.key] = [None, None]
            elif self.depth == 1 and c == "," and self.state == "value":
                if self.key in f:
                    f[self.key][1] = i
                self.state = "key"

    def _value(self, key: str) -> str | None:
        span = self.fields.get(key)
        if span is None or span[0] is None or span[1] is None:
            return None
        return self.buf[span[0]:span[1]].rstrip()

    def _stream(self) -> None:
        block, parser = self.block, self.block.parser
        if block.call is None:
            raw = self._value("name")
            if raw is None:
                return
            try:
                name = json.loads(raw)
            except ValueError:
                return
            if not isinstance(name, str) or not name:
                return
            block.call = parser.begin_call(name)
        key = next((k for k in self.ARG_KEYS if k in self.fields and self.fields[k][0] is not None), None)
        if key is None:
            if self.end is not None:
                parser.add_arguments(block.call, "{}")
            return
        start, end = self.fields[key]
        if self.buf[start] == '"':  # arguments as a JSON string: sent decoded, once complete
            if end is not None and not block.call.arguments:
                try:
                    parser.add_arguments(block.call, str(json.loads(self.buf[start:end].rstrip())))
                except ValueError:
                    pass
            return
        avail = self.buf[start:end if end is not None else self.i].rstrip()
        parser.add_arguments(block.call, avail[self.sent:])
        self.sent = max(self.sent, len(avail))
