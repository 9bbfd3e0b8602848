"""Scheduler: who runs this tick, how many tokens each, and who gives up cells when they run short.

Each tick builds one flat step: a decode token for every running sequence, then prefill chunks
(chunked prefill, mixed with the decodes) of running-but-unfinished and waiting sequences, up to
`max_num_batched_tokens` tokens and `max_num_seqs` sequences. Admission is `can_extend` before the
forward. When cells run short it first drops the cells of idle and waiting sequences (least
recently used first), then preempts the most recently admitted running sequence (its cells go,
its tokens stay; it goes back to the front of the queue and re-prefills later). It never fails
what is in flight to make room.
"""

import heapq
import time
from collections import deque
from dataclasses import dataclass

from engine.cells import CellCache
from engine.sequence import SeqStatus, Sequence


@dataclass
class Chunk:
    seq: Sequence
    start: int  # first token index (= position) of the chunk
    n_tokens: int

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.n_tokens]

    @property
    def completes(self) -> bool:
        """After this chunk every token of the sequence has a cell: its last row gives next-token logits."""
        return self.start + self.n_tokens == len(self.seq.token_ids)


class Scheduler:
    """Holds the waiting queue, the running set, and the slots and cells they use.

    Guarantees: a sequence's cells always cover exactly positions [0, n_cached); every planned
    step fits in the free cells (so `begin_step` cannot raise `CacheFull`); sequences holding
    cells always hold a slot, and slots are handed out lowest first.
    """

    def __init__(self, cache: CellCache, max_num_seqs: int, max_num_batched_tokens: int):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.holders: dict[int, Sequence] = {}  # slot -> sequence holding it
        self._free_slots = list(range(cache.max_seqs))
        heapq.heapify(self._free_slots)
        self.preemptions = 0

    # ----- queue -----------------------------------------------------------------------------
    def enqueue(self, seq: Sequence, front: bool = False) -> None:
        seq.status = SeqStatus.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queue/running set (its cells are untouched)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def add_running(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        seq.admitted_at = time.monotonic()
        self.running.append(seq)

    # ----- slots and cells -------------------------------------------------------------------
    def acquire_slot(self, seq: Sequence, keep: Sequence | None = None) -> bool:
        """Give `seq` a slot, evicting an idle sequence's cells if none is free (never `seq`'s or `keep`'s:
        a fork's parent must keep the cells its child is about to share)."""
        if seq.slot is not None:
            return True
        if not self._free_slots and not self._evict_one(exclude=(seq, keep)):
            return False
        seq.slot = heapq.heappop(self._free_slots)
        self.holders[seq.slot] = seq
        return True

    def release(self, seq: Sequence) -> None:
        """Drop all of `seq`'s cells and its slot; its tokens stay."""
        if seq.slot is None:
            return
        self.cache.seq_rm(seq.slot)
        del self.holders[seq.slot]
        heapq.heappush(self._free_slots, seq.slot)
        seq.slot, seq.n_cached = None, 0

    def _evict_one(self, exclude: tuple[Sequence | None, ...] = ()) -> bool:
        """Free the cells of the least recently used sequence that is not running nor excluded."""
        victims = [s for s in self.holders.values()
                   if s.status is not SeqStatus.RUNNING and not any(s is e for e in exclude)]
        if not victims:
            return False
        self.release(min(victims, key=lambda s: s.last_used))
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        self.enqueue(seq, front=True)
        self.preemptions += 1

    # ----- one tick --------------------------------------------------------------------------
    def schedule(self) -> list[Chunk]:
        self._chunks: dict[Sequence, Chunk] = {}  # insertion-ordered; sequences hash by identity
        self._step_tokens = 0
        self._preempted_now: set[Sequence] = set()
        budget = self.max_num_batched_tokens
        # Decodes first (1 token each), then unfinished prefills, oldest first.
        for seq in sorted(self.running, key=lambda s: (s.pending > 1, s.admitted_at)):
            if seq.status is not SeqStatus.RUNNING or budget == 0:
                continue  # preempted while making room for an older sequence
            n = min(seq.cache_target() - seq.n_cached, budget)
            if n > 0 and self._room_for_running(seq, n):
                self._add_chunk(seq, n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq in self._preempted_now:
                break  # it just gave up its cells for this very step
            n = min(seq.cache_target() - seq.n_cached, budget)
            if n > 0 and not self._room_for_waiting(seq, n):
                break
            self.waiting.popleft()
            self.add_running(seq)
            if n > 0:
                self._add_chunk(seq, n)
                budget -= n
        return list(self._chunks.values())

    def _add_chunk(self, seq: Sequence, n: int) -> None:
        self._chunks[seq] = Chunk(seq, seq.n_cached, n)
        self._step_tokens += n

    def _room_for_running(self, seq: Sequence, n: int) -> bool:
        while not self.cache.can_extend(self._step_tokens + n):
            if self._evict_one():
                continue
            victim = max(self.running, key=lambda s: s.admitted_at)
            if victim in self._chunks:
                self._step_tokens -= self._chunks.pop(victim).n_tokens
            self._preempted_now.add(victim)
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _room_for_waiting(self, seq: Sequence, n: int) -> bool:
        if not self.acquire_slot(seq):
            return False
        while not self.cache.can_extend(self._step_tokens + n):
            if not self._evict_one(exclude=(seq,)):
                return False
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)
