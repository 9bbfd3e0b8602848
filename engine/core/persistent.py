"""Persistent sequences: the conversations a client creates, continues, forks, truncates and deletes.

`SequenceTable` keeps them by id and turns each verb into scheduler requests (share, cut, release):
it never touches cells itself. A verb that is refused raises before it changes anything. A sequence
that is generating can be forked (its tokens so far) but not truncated; deleting one is the engine's
verb, because it must first cancel the request running on it.
"""

import time

from engine.api.errors import InvalidRequest, SequenceBusy, SequenceNotFound
from engine.api.ids import new_id
from engine.api.outputs import SequenceInfo
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence


class SequenceTable:
    """Persistent sequences by id, over one scheduler."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.by_id: dict[str, Sequence] = {}

    def get(self, seq_id: str) -> Sequence:
        seq = self.by_id.get(seq_id)
        if seq is None:
            raise SequenceNotFound(f"no sequence {seq_id!r}: it was deleted, expired, or never existed")
        return seq

    def new(self, token_ids: list[int] | None = None, parent: str | None = None) -> Sequence:
        seq = Sequence(new_id("seq"), list(token_ids or []), persistent=True, parent=parent)
        self.by_id[seq.seq_id] = seq
        return seq

    def fork(self, seq_id: str, at: int | None = None) -> Sequence:
        """A new sequence sharing `seq_id`'s first `at` tokens (all if None) and their cells."""
        parent = self.get(seq_id)
        at = len(parent.token_ids) if at is None else at
        if not 1 <= at <= len(parent.token_ids):
            raise InvalidRequest(f"fork at={at} is outside [1, {len(parent.token_ids)}]", "at")
        child = Sequence(new_id("seq"), parent.token_ids[:at], persistent=True, parent=seq_id)
        self.scheduler.fork(parent, child, min(parent.n_cached, at - 1))
        self.by_id[child.seq_id] = child
        return child

    def truncate(self, seq_id: str, length: int) -> Sequence:
        seq = self.get(seq_id)
        if seq.request is not None:
            raise SequenceBusy(f"sequence {seq_id} is generating; cancel it before truncating")
        if not 1 <= length <= len(seq.token_ids):
            raise InvalidRequest(f"length={length} is outside [1, {len(seq.token_ids)}]", "length")
        if seq.n_cached > length - 1:
            self.scheduler.uncache(seq, length - 1)
        del seq.token_ids[length:]
        seq.last_used = time.monotonic()
        return seq

    def drop(self, seq_id: str) -> None:
        """Forget an idle sequence and release its cells (the engine cancels its request first)."""
        self.scheduler.release(self.by_id.pop(seq_id))

    def info(self, seq_id: str) -> SequenceInfo:
        seq = self.get(seq_id)
        owned, shared = self.scheduler.cells_of(seq)
        return SequenceInfo(seq.seq_id, len(seq.token_ids), list(seq.token_ids), seq.status.value, seq.parent,
                            seq.n_cached, owned, shared, seq.created, seq.last_used)

    def idle_longer_than(self, ttl_s: float, now: float) -> list[str]:
        return [s.seq_id for s in self.by_id.values() if s.request is None and now - s.last_used > ttl_s]
