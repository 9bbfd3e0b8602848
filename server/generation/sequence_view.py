"""The sequence object (`sequence_view`): what the sequence routes answer and what `GET /v1/cache` lists, as
a plain dict from the engine's `SequenceInfo`."""

import time

from engine.api.outputs import SequenceInfo


def _epoch(monotonic_t: float) -> float:
    """`last_used` is a time.monotonic() stamp (TTL arithmetic); clients want wall-clock seconds."""
    return round(time.time() - (time.monotonic() - monotonic_t), 3)


def sequence_view(info: SequenceInfo, text: str | None = None, with_tokens: bool = False) -> dict:
    out = {
        "id": info.seq_id,
        "object": "sequence",
        "length": info.length,
        "status": info.status,
        "parent": info.parent,
        # cached_tokens: with cells in the pool; saved_tokens: with cells in the state dir (--state-dir), which
        # load when the sequence next runs instead of being recomputed
        "cells": {"owned": info.cells_owned, "shared": info.cells_shared, "cached_tokens": info.n_cached,
                  "saved_tokens": info.n_saved},
        "created": int(info.created),  # already wall-clock (time.time())
        "last_used": _epoch(info.last_used),
    }
    if with_tokens:
        out["token_ids"] = list(info.token_ids)
    if text is not None:
        out["text"] = text
    return out
