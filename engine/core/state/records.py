"""SequenceRecord: one persistent sequence's truth as it is written to disk and read back.

A record holds what a sequence needs to continue exactly where it was: its token ids, its parent and
fork point, its wall-clock times, and which saved cell chunks cover its first `cells_n` tokens (a cache:
without them the tokens are recomputed). Records read from a file or an archive are checked as a
client's input would be (id shape, token ids, lengths): a bad one is refused with the reason, never
trusted.
"""

import json
import re
from dataclasses import dataclass, field

from engine.api.ids import is_valid_id

VERSION = 1
_KEY_RE = re.compile(r"[0-9a-f]{32,64}")


class BadRecord(ValueError):
    """A record that cannot be trusted: the message says which field and why."""


@dataclass
class SequenceRecord:
    seq_id: str
    token_ids: list[int]
    parent: str | None = None
    fork_at: int | None = None  # tokens taken from the parent when it was forked
    created: float = 0.0  # wall clock (time.time())
    last_used: float = 0.0  # wall clock of the last change
    cells_n: int = 0  # tokens [0, cells_n) have saved cells ...
    chunks: list[str] = field(default_factory=list)  # ... in these chunk files, in position order
    lora: tuple[str, float] | None = None  # the LoRA adapter (name, scale) it runs under; such a record has no cells

    @staticmethod
    def lora_of(seq) -> tuple[str, float] | None:
        return (seq.lora.name, seq.lora.scale) if seq.lora is not None else None

    def to_json(self) -> str:
        return json.dumps({"v": VERSION, "id": self.seq_id, "token_ids": self.token_ids, "parent": self.parent,
                           "fork_at": self.fork_at, "created": self.created, "last_used": self.last_used,
                           "cells": {"n": self.cells_n, "chunks": self.chunks},
                           **({"lora": list(self.lora)} if self.lora else {})}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "SequenceRecord":
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise BadRecord(f"not JSON ({exc})") from None
        return cls.from_dict(doc)

    @classmethod
    def from_dict(cls, doc: object) -> "SequenceRecord":
        if not isinstance(doc, dict) or doc.get("v") != VERSION:
            raise BadRecord(f"not a version-{VERSION} sequence record")
        seq_id, parent, tokens = doc.get("id"), doc.get("parent"), doc.get("token_ids")
        if not is_valid_id(seq_id, "seq"):
            raise BadRecord(f"id {str(seq_id)[:80]!r} is not a sequence id")
        if parent is not None and not is_valid_id(parent, "seq"):
            raise BadRecord(f"parent {str(parent)[:80]!r} is not a sequence id")
        if not isinstance(tokens, list) or not tokens or not all(_is_int(t) and t >= 0 for t in tokens):
            raise BadRecord("token_ids must be a non-empty list of non-negative integers")
        cells = doc.get("cells") or {}
        n, chunks = cells.get("n", 0), cells.get("chunks", [])
        if not _is_int(n) or not 0 <= n < len(tokens) + 1 or not isinstance(chunks, list) \
                or not all(isinstance(k, str) and _KEY_RE.fullmatch(k) for k in chunks):
            raise BadRecord("cells must be {n: 0..len(token_ids), chunks: [hex keys]}")
        fork_at, lora = doc.get("fork_at"), doc.get("lora")
        if lora is not None and not (isinstance(lora, list) and len(lora) == 2 and isinstance(lora[0], str)
                                     and isinstance(lora[1], (int, float)) and not isinstance(lora[1], bool)):
            raise BadRecord("lora must be [adapter name, scale]")
        return cls(seq_id, list(tokens), parent, fork_at if _is_int(fork_at) else None,
                   _float(doc.get("created")), _float(doc.get("last_used")), n if chunks and lora is None else 0,
                   list(chunks) if lora is None else [], (lora[0], float(lora[1])) if lora is not None else None)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _float(x: object) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else 0.0
