"""The buffers of resumable streams (llama.cpp's `X-Conversation-Id`): the bytes of one SSE answer, kept while
its generation runs and for `TTL_S` after it ends, readable from any offset by any number of readers.

Guarantees: one conversation id has at most one live kept stream (a new stream under the same id cancels the one
before it); a kept stream keeps at most `MAX_BYTES`, dropping its oldest bytes first (a reader asking for dropped
bytes learns it: `OffsetLost`); a finished kept stream is forgotten `TTL_S` seconds after it ended. Everything runs
on the event loop: no locks, a reader waits on an event the writer sets.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

TTL_S = 300.0  # llama-server's: how long a finished stream stays readable
MAX_BYTES = 4 * 1024 * 1024  # llama-server's cap on one stream's buffer


class OffsetLost(Exception):
    """The reader's offset is before the oldest byte the kept stream still holds."""


@dataclass
class KeptStream:
    """One conversation's stream: `append` while it runs, `finish` when it ends (or is stopped), `read` from an
    offset (replays what is buffered, then follows the live bytes until the end)."""

    conversation_id: str
    max_bytes: int = MAX_BYTES
    started: float = field(default_factory=time.time)
    completed: float = 0.0  # unix time it ended; 0 while it runs
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)  # set by a stop (DELETE, or a newer stream)
    dropped: int = 0  # bytes dropped from the front to keep under max_bytes
    _buffer: bytearray = field(default_factory=bytearray)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.completed > 0

    @property
    def total(self) -> int:
        """Bytes that ever entered the kept stream."""
        return self.dropped + len(self._buffer)

    def append(self, data: bytes) -> None:
        if self.done or not data:
            return
        self._buffer += data
        over = len(self._buffer) - self.max_bytes
        if over > 0:
            del self._buffer[:over]
            self.dropped += over
        self._notify()

    def finish(self) -> None:
        if not self.done:
            self.completed = time.time()
            self._notify()

    def stop(self) -> None:
        """Cancel the producer (its request sees its client leave) and end the kept stream for its readers."""
        self.cancelled.set()
        self.finish()

    def check_offset(self, offset: int) -> None:
        if offset < self.dropped:
            raise OffsetLost(f"offset {offset} is gone: this stream keeps its last {self.max_bytes} bytes, "
                             f"from offset {self.dropped}; restart the request")

    async def read(self, offset: int) -> AsyncIterator[bytes]:
        """The bytes from `offset` on: what is buffered, then each new piece, until the kept stream ends."""
        while True:
            self.check_offset(offset)
            wake = self._wake
            if offset < self.total:
                chunk = bytes(self._buffer[offset - self.dropped:])
                offset += len(chunk)
                yield chunk
                continue
            if self.done:
                return
            await wake.wait()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    def describe(self) -> dict:
        """llama-server's `/v1/streams/lookup` entry."""
        return {"conversation_id": self.conversation_id, "is_done": self.done, "total_bytes": self.total,
                "started_at": int(self.started), "completed_at": int(self.completed)}


class KeptStreams:
    """Conversation id -> its live or recently finished stream."""

    def __init__(self, ttl_s: float = TTL_S, max_bytes: int = MAX_BYTES):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._kept: dict[str, KeptStream] = {}

    def open(self, conversation_id: str) -> KeptStream:
        """A new kept stream for `conversation_id`; the one it replaces (if any) is stopped."""
        self._expire()
        previous = self._kept.get(conversation_id)
        kept = self._kept[conversation_id] = KeptStream(conversation_id, self.max_bytes)
        if previous is not None:
            previous.stop()
        return kept

    def get(self, conversation_id: str) -> KeptStream | None:
        self._expire()
        return self._kept.get(conversation_id)

    def drop(self, kept: KeptStream) -> None:
        """Forget `kept` (a request that did not stream: nothing to replay), if it is still the current one."""
        if self._kept.get(kept.conversation_id) is kept:
            del self._kept[kept.conversation_id]
        kept.finish()

    def stop(self, conversation_id: str) -> bool:
        """The user's stop: cancel the conversation's stream and forget it; False if there was none."""
        kept = self._kept.pop(conversation_id, None)
        if kept is not None:
            kept.stop()
        return kept is not None

    def lookup(self, conversation_ids: list[str]) -> list[KeptStream]:
        """The kept streams of the ids asked for (each id also matches `<id>::<model>`, llama-server's router keys);
        never the ids nobody asked about, so a caller cannot list others' conversations."""
        self._expire()
        return [s for cid in conversation_ids for key, s in self._kept.items()
                if key == cid or key.startswith(cid + "::")]

    def _expire(self) -> None:
        cutoff = time.time() - self.ttl_s
        for key in [k for k, s in self._kept.items() if s.done and s.completed <= cutoff]:
            del self._kept[key]
