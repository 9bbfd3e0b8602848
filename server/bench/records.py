"""The per-request record: everything the client observed about one streamed request.

All times are seconds from `time.perf_counter()`; `sent_at` is relative to the start of the level,
the others relative to the moment the request was sent. Metrics are computed only from these
records, so a results file can be re-analysed later without re-running the load.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    """One request as seen by the client.

    `error` is None for a success; otherwise a short label used to count errors: the HTTP status
    as a string ("429", "503", ...), "sse_error" (a `data: {"error": ...}` event mid-stream),
    "truncated" (the stream ended without `[DONE]` or a finish_reason), "timeout" or "transport".
    `output_tokens` is the server's `usage.completion_tokens` when it sent one, else the number of
    content chunks (`usage_reported` says which). `cached_tokens` is the server's
    `usage.prompt_tokens_details.cached_tokens` (prompt tokens served from its prefix cache), when sent;
    `turn` is the 1-based turn number of a multi-turn conversation's request; `output_digest` a digest of
    the text it streamed (equal digests: equal outputs, e.g. speculative decoding on and off, greedy).
    """

    index: int
    kind: str = "completion"
    group: int | None = None
    max_tokens: int = 0
    prompt_words: int = 0
    sent_at: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    usage_reported: bool = False
    prompt_tokens: int | None = None
    output_chars: int = 0
    status: int | None = None
    error: str | None = None
    error_message: str = ""
    fork_latency: float | None = None
    cleanup_failures: int = 0
    turn: int | None = None
    cached_tokens: int | None = None
    output_digest: str | None = None  # the streamed text's sha1 (16 hex): compares two servers' outputs
    accepted_draft_tokens: int | None = None  # usage.cellserve_draft_tokens: speculative counts, when sent
    rejected_draft_tokens: int | None = None

    @property
    def ok(self) -> bool:
        """True when the request completed without any error."""
        return self.error is None

    def itl(self) -> list[float]:
        """Gaps between consecutive content chunks, in seconds (one per chunk after the first)."""
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    def tpot(self) -> float | None:
        """(latency - ttft) / (output_tokens - 1); None when it is undefined (fewer than 2 tokens)."""
        if self.latency is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def fail(self, label: str, message: str, status: int | None = None) -> RequestRecord:
        """Mark the record failed with an error label and a human-readable message."""
        self.error = label
        self.error_message = message[:500]
        if status is not None:
            self.status = status
        return self

    def to_dict(self) -> dict:
        """A JSON-ready dict of every field (no derived values)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RequestRecord:
        """Rebuild a record written by `to_dict` (unknown keys are ignored)."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)
