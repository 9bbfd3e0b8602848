"""A minimal server-sent-events decoder for OpenAI-style streams.

OpenAI-compatible servers send `data: {json}` followed by a blank line per chunk and finish with
`data: [DONE]`. Per the SSE spec, several `data:` lines before a blank line form one event (joined
with newlines); `:` comment lines and other fields (`event:`, `id:`, `retry:`) are ignored. Feeding
lines one at a time and calling `flush()` at end of stream yields every event exactly once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

DONE = "[DONE]"


@dataclass
class SseEvent:
    """One decoded event: `done` for `[DONE]`, else `data` holds the parsed JSON (or None + `raw`)."""

    raw: str
    data: dict | None = None
    done: bool = False

    @property
    def error(self) -> object | None:
        """The `error` member of an error event (`data: {"error": ...}`), else None."""
        if isinstance(self.data, dict):
            return self.data.get("error")
        return None


def _make_event(payload: str) -> SseEvent:
    if payload.strip() == DONE:
        return SseEvent(raw=payload, done=True)
    try:
        parsed = json.loads(payload)
    except json.JSONDecodeError:
        return SseEvent(raw=payload)
    return SseEvent(raw=payload, data=parsed if isinstance(parsed, dict) else None)


class SseDecoder:
    """Turns stream lines (without their line terminators) into `SseEvent`s."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> list[SseEvent]:
        """Consume one line; return the events it completed (zero or one)."""
        line = line.rstrip("\r\n")
        if line == "":
            return self.flush()
        if line.startswith(":"):
            return []
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return []

    def flush(self) -> list[SseEvent]:
        """Emit the pending event, if any (call at end of stream: some servers omit the last blank line)."""
        if not self._data:
            return []
        payload = "\n".join(self._data)
        self._data = []
        return [_make_event(payload)]
