"""Scheduler: who runs this tick, how many tokens each, and who gives up cells when they run short.

Each tick builds one flat step: a decode token for every running sequence, then prefill chunks
(chunked prefill, mixed with the decodes) of running-but-unfinished and waiting sequences, up to
`max_num_batched_tokens` tokens and `max_num_seqs` sequences. Admission is `can_extend` before the
forward. When cells run short it first drops the cells of idle and waiting sequences (least
recently used first), then preempts the running sequence of lowest priority, the most recently
admitted among equals (its cells go, its tokens stay; it goes back to the front of its priority in
the queue and re-prefills later). It never fails what is in flight to make room.

Priority (`SamplingParams.priority`, lower first, vLLM's convention): the queue is kept in
(priority, arrival) order, so a request is admitted before every waiting request of a higher
value; decodes and prefill chunks of running sequences are planned in priority order too. A
running request is never preempted for a waiting one; with every priority 0 (the default) the
order is first come, first served.

The scheduler is the one owner of cell claims and `n_cached`: the engine asks it to share
(`share`), cut (`uncache`), record a forward (`advance`) and its verified drafts (`settle_draft`),
retire or release a sequence. With
prefix caching on, a finished request's sequence is *retired*: it keeps its cells as a cached prefix
(evicted first, least recently used first, possibly only its tail), and every sequence admitted with
no cells first shares the longest prefix any holder has cached (`PrefixIndex`, engine/core/prefix_index.py).
With a state dir it then loads what the disk has past that (`page_in`): saved cells, not a recompute.
"""

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

from engine.cells.cache import CellCache
from engine.core.plan import Chunk, Queues, SchedulerOutput
from engine.core.prefix_index import BLOCK, PrefixIndex
from engine.core.sequence import Choice, SeqStatus, Sequence
from engine.core.state.store import DurableStore, load_chunks

PREFIX_MIN_TOKENS = BLOCK  # a cached prefix shorter than one index block can never be found: not kept


def priority(seq: Sequence) -> int:
    """Its request's priority (lower runs first); 0 for a sequence without a request."""
    return seq.request.params.priority if seq.request is not None else 0


@dataclass
class StepBudget:
    """One tick being planned: the chunks chosen so far (insertion-ordered; sequences hash by
    identity), their tokens, and the sequences preempted to make room in this very tick."""

    chunks: dict[Sequence, Chunk] = field(default_factory=dict)
    tokens: int = 0
    preempted: set[Sequence] = field(default_factory=set)
    cached: list[tuple[Sequence, int]] = field(default_factory=list)  # admission lookups: tokens found cached

    def add(self, seq: Sequence, n: int, draft: list[int] | None = None) -> None:
        self.chunks[seq] = Chunk(seq, seq.n_cached, n, draft or [])
        self.tokens += n + len(draft or ())

    def drop(self, seq: Sequence) -> None:
        if seq in self.chunks:
            chunk = self.chunks.pop(seq)
            self.tokens -= chunk.n_tokens + len(chunk.draft)


class Scheduler:
    """Holds the waiting queue, the running set, and the slots and cells they use.

    Guarantees: a sequence's cells always cover exactly positions [0, n_cached); every planned
    step fits in the free cells (so `begin_step` cannot raise `CacheFull`); sequences holding
    cells always hold a slot, and slots are handed out lowest first.
    """

    def __init__(self, cache: CellCache, max_num_seqs: int, max_num_batched_tokens: int, *,
                 prefix_caching: bool, prefill_while_decoding: int, prefill_backlog_ticks: int,
                 store: DurableStore | None = None, mirror=None):
        """`store`: with a state dir, the saved cells `page_in` loads at admission instead of a recompute.
        `mirror`: with a draft model, its pool, which follows these cells by slot (`released`, `cut`, `shared`:
        see engine/spec/draft_model.py); cells loaded from disk it does not get (it prefills them when it drafts)."""
        self.cache = cache
        self.prefix_caching = prefix_caching
        self.prefix = PrefixIndex()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # While sequences decode, prefill chunks share a tick with them, and on a CPU a tick's time grows
        # with its tokens (each costs about what a decode does), so a long prefill chunk stalls every
        # stream. Capping a tick's prefill tokens at max(this, decoders) keeps it within about twice a
        # decode-only tick; a prompt takes a few more ticks, which costs no throughput (same tokens).
        # Long prompts would starve under that cap alone (a 1,000-token prompt behind 32 tokens a tick
        # waits 30+ ticks, and every prompt queued behind it longer), so the cap also grows with the
        # backlog: whatever is waiting to be prefilled drains within about `prefill_backlog_ticks` ticks.
        # (both, like every limit here, come from EngineArgs: their one source and their defaults)
        self.prefill_while_decoding = prefill_while_decoding
        self.prefill_backlog_ticks = prefill_backlog_ticks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.holders: dict[int, Sequence] = {}  # slot -> sequence holding it
        self._free_slots = list(range(cache.max_seqs))
        heapq.heapify(self._free_slots)
        self.preemptions = 0
        self.store = store
        self.mirror = mirror

    # ----- queue -----------------------------------------------------------------------------
    def queues(self) -> Queues:
        """Who runs (a copy) and how many wait: the read the speculative decoder makes before each tick."""
        return Queues(list(self.running), len(self.waiting))

    def start(self, seq: Sequence, choice: Choice) -> None:
        """`choice` generates on `seq` from now on: it (re)joins the queue."""
        seq.choice = choice
        self.remove(seq)
        self.enqueue(seq)

    def touch(self, seq: Sequence) -> None:
        """`seq` was used now (a verb on an idle sequence): it is evicted and expires later."""
        seq.last_used = time.monotonic()

    def enqueue(self, seq: Sequence, front: bool = False) -> None:
        """Queue `seq` after every waiting sequence of its priority or a better one (`front`: before those
        of its own priority, as a preempted sequence goes back)."""
        seq.status = SeqStatus.WAITING
        seq.lookup_done = False
        p = priority(seq)
        at = next((i for i, other in enumerate(self.waiting)
                   if priority(other) > p or (front and priority(other) == p)), len(self.waiting))
        self.waiting.insert(at, seq)

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
        if self.mirror is not None:
            self.mirror.released(seq.slot)
        del self.holders[seq.slot]
        heapq.heappush(self._free_slots, seq.slot)
        seq.slot, seq.n_cached = None, 0
        self.prefix.forget(seq)

    def rebind(self, seq: Sequence, lora) -> None:
        """`seq` (not running) continues under the adapter binding `lora`: its cells go if they were computed
        under another (K/V belong to the weights that computed them)."""
        if seq.lora != lora:
            self.release(seq)
            seq.lora = lora

    def retire(self, seq: Sequence) -> None:
        """A finished request's sequence: keep its cells as a cached prefix, or release them."""
        seq.status = SeqStatus.FINISHED
        if self.prefix_caching and seq.slot is not None and seq.n_cached >= PREFIX_MIN_TOKENS:
            seq.last_used = time.monotonic()
        else:
            self.release(seq)

    def set_cached(self, seq: Sequence, n: int) -> None:
        """`seq` now holds cells for exactly positions [0, n) (after a forward, a share or a cut)."""
        seq.n_cached = n
        self.prefix.update(seq)

    def advance(self, chunks: list[Chunk]) -> None:
        """A forward ran `chunks`: each sequence now has cells for its chunk's own tokens (a draft's cells are
        verification's to keep or drop: `set_cached`, `uncache`), and was used now."""
        for c in chunks:
            self.set_cached(c.seq, c.seq.n_cached + c.n_tokens)
            c.seq.last_used = time.monotonic()

    def settle_draft(self, seq: Sequence, valid: int, claimed: int) -> None:
        """A verified draft: its cells of positions [valid, claimed) hold tokens that were not kept: drop them
        (seq_rm) and record what is cached. An idle persistent sequence keeps its last token uncached
        (Sequence.cache_target). A draft kept whole drops nothing: no pass over the pool then."""
        if seq.slot is None:
            return
        valid = min(valid, len(seq.token_ids) - (1 if seq.persistent and seq.request is None else 0))
        if valid < claimed or valid < seq.n_cached:
            self.uncache(seq, valid)
        else:
            self.set_cached(seq, valid)

    def share(self, src: Sequence, dst: Sequence, upto: int) -> None:
        """`dst` (holding a slot) also owns `src`'s cells of positions [dst.n_cached, upto): no copy.
        The caller guarantees both have the same tokens there, so dst's cells stay [0, upto)."""
        self.cache.seq_cp(src.slot, dst.slot, upto=upto, start=dst.n_cached)
        if self.mirror is not None:
            self.mirror.shared(src.slot, dst.slot, upto)
        self.set_cached(dst, upto)

    def uncache(self, seq: Sequence, n: int) -> int:
        """Drop `seq`'s cells from position n on (its tokens stay); return the cells that became free."""
        freed = self.cache.seq_rm(seq.slot, n)
        if self.mirror is not None:
            self.mirror.cut(seq.slot, n)
        self.set_cached(seq, n)
        return freed

    def fork(self, parent: Sequence, child: Sequence, upto: int) -> None:
        """A new sequence (no slot yet) shares `parent`'s cells of positions [0, upto) when the parent
        holds them and a slot is free (evicting an idle sequence, never the parent); else it holds
        nothing and prefills when it runs. Either way its tokens are the truth."""
        if parent.slot is not None and upto > 0 and self.acquire_slot(child, keep=parent):
            self.share(parent, child, upto)

    def start_child(self, parent: Sequence, child: Sequence) -> None:
        """n > 1: a queued child of a prefilled parent runs at once on the parent's cells when a slot
        is free; otherwise it stays queued and prefills on its own."""
        if self.acquire_slot(child):
            self.share(parent, child, parent.n_cached)
            self.remove(child)
            self.add_running(child)

    # ----- restore (engine/core/state): cells that come from disk, not from a forward ---------------
    def share_longest(self, seq: Sequence, limit: int) -> int:
        """`seq` (idle) also owns the longest prefix, up to `limit` tokens, that any holder has cells for,
        as a fork would (no copy): a restored family's common prefix lands in the pool once. Returns
        `seq.n_cached`."""
        holder, m = self.prefix.longest(seq.token_ids, limit, seq.lora) if len(self.prefix) else (None, 0)
        if holder is not None and holder is not seq and m > seq.n_cached and self.acquire_slot(seq, keep=holder):
            self.share(holder, seq, m)
        return seq.n_cached

    def load_cells(self, seq: Sequence, keys, values, reserve: int | None = None) -> bool:
        """`seq` (not running) gains cells for positions [n_cached, n_cached + n) holding saved K/V
        (`CellCache.seq_load`). `reserve` None (a restore): only free cells are used. An int (admission,
        `page_in`): that many cells must stay free beside them for this tick's plan, and idle sequences and
        cached prefixes are evicted to make room, as for a prefill (never a running sequence). False, loading
        nothing, when there is no room or no slot: the tokens are then prefilled when it runs."""
        n = keys.shape[2]
        while not self.cache.can_extend((reserve or 0) + n):
            if reserve is None or not self._evict_one(exclude=(seq,), need=reserve + n - self.cache.free_cells()):
                return False
        if not self.acquire_slot(seq):
            return False
        self.cache.seq_load(seq.slot, seq.n_cached, keys, values)
        self.set_cached(seq, seq.n_cached + n)
        return True

    def page_in(self, seq: Sequence, reserve: int = 0) -> int:
        """Admission, with a state dir (`store` given): `seq`'s tokens past its cells whose K/V are saved on disk
        (its own history after a lazy restore or after it lost its cells in RAM, its parent's prefix, any
        saved prefix of its tokens) are loaded instead of recomputed, as far as the pool has room beside the
        `reserve` cells this tick's plan needs (see `load_cells`); never its last token, whose logits are
        needed. A sequence that scores its prompt (`shares_prefix` False) loads nothing, and a plain request
        only with prefix caching on. Returns `seq.n_cached` if it gained any cells, else 0."""
        if self.store is None or not seq.shares_prefix or not (seq.persistent or self.prefix_caching) \
                or seq.lora is not None:  # an adapter's cells are never saved (engine/core/state/store.py)
            return 0
        before = seq.n_cached
        limit = min(len(seq.token_ids) - 1, seq.cache_target())
        if limit > seq.n_cached:  # shared from the pool, or loaded from the saved chunks its tokens begin with
            spans = self.store.saved_prefix(seq.token_ids, limit)
            load_chunks(seq, spans, limit, self, self.store.cells.read, reserve)
        return seq.n_cached if seq.n_cached > before else 0

    def read_cells(self, seq: Sequence, p0: int, p1: int):
        """(K, V) of `seq`'s cells for positions [p0, p1) (`CellCache.seq_read`), for saving them."""
        return self.cache.seq_read(seq.slot, p0, p1)

    def finish(self, seq: Sequence, reason: str) -> None:
        """A choice ended (`reason` is its finish reason): a persistent sequence goes idle and keeps its
        cells but the last token's (see `Sequence.cache_target`); a failed one drops its cells (a failed
        step's cells are not trusted as a cached prefix); any other is retired."""
        seq.choice = None
        self.remove(seq)
        if seq.persistent:
            seq.status = SeqStatus.IDLE
            seq.last_used = time.monotonic()
            if seq.n_cached > len(seq.token_ids) - 1:
                self.uncache(seq, len(seq.token_ids) - 1)
        elif reason == "error":
            self.release(seq)
            seq.status = SeqStatus.FINISHED
        else:
            self.retire(seq)

    def cells_of(self, seq: Sequence) -> tuple[int, int]:
        """(cells `seq` owns, of which shared with another sequence); (0, 0) without a slot."""
        if seq.slot is None:
            return 0, 0
        return self.cache.seq_len(seq.slot), self.cache.shared_cells(seq.slot)

    def cached_prefix_cells(self) -> int:
        """Cells owned only by cached prefixes: evicted on demand, so free in all but name (one
        reduction over the owner table: for reports, not for every tick)."""
        cached = {s.slot for s in self.cached_prefixes()}
        if not cached:
            return 0
        live = [slot for slot in self.holders if slot not in cached]
        return self.cache.cells_owned_only_by(sorted(cached), live)

    def cached_prefixes(self) -> list[Sequence]:
        return [s for s in self.holders.values() if s.status is SeqStatus.FINISHED]

    def make_room(self, n: int) -> bool:
        """Evict cached prefixes and idle sequences (never running ones) until `n` more cells fit; whether they do."""
        while not self.cache.can_extend(n) and self._evict_one(need=n):
            pass
        return self.cache.can_extend(n)

    def _evict_one(self, exclude: tuple[Sequence | None, ...] = (), need: int | None = None) -> bool:
        """Free cells (or, with `need` None, a slot): the least recently used cached prefix first, cut
        by `need` tokens from its tail when that keeps some of it; else the least recently used
        sequence that is neither running nor excluded."""
        victims = [s for s in self.holders.values()
                   if s.status is not SeqStatus.RUNNING and not any(s is e for e in exclude)]
        if not victims:
            return False
        cached = [s for s in victims if s.status is SeqStatus.FINISHED]
        victim = min(cached or victims, key=lambda s: s.last_used)
        keep = victim.n_cached - need if cached and need is not None else 0
        if keep >= PREFIX_MIN_TOKENS and self.uncache(victim, keep):
            return True
        self.release(victim)
        return True

    def share_cached_prefix(self, seq: Sequence) -> int:
        """Admission: extend `seq`'s cells with the longest prefix some holder has cached (never its
        last token, whose logits are needed). A sequence that already has cells (a continued
        conversation) gains only what lies past them. Returns how many tokens `seq` now has cells
        for without prefilling them (0 when nothing was found)."""
        if not self.prefix_caching or not seq.shares_prefix or seq.lookup_done:
            return 0
        seq.lookup_done = True  # once per admission: a head that waits is not looked up every tick
        tokens = seq.token_ids
        limit = min(len(tokens) - 1, seq.cache_target())
        self.prefix.stats.queried_tokens += len(tokens) - seq.n_cached
        holder, m = self.prefix.longest(tokens, limit, seq.lora) if len(self.prefix) else (None, 0)
        if holder is None or holder is seq or m <= seq.n_cached or m < PREFIX_MIN_TOKENS:
            return 0
        if not self.acquire_slot(seq, keep=holder):
            return 0
        gained = m - seq.n_cached
        self.share(holder, seq, m)
        holder.last_used = time.monotonic()
        self.prefix.stats.hit_tokens += gained
        return m

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        self.enqueue(seq, front=True)
        self.preemptions += 1

    # ----- one tick --------------------------------------------------------------------------
    def schedule(self, drafts: dict[Sequence, list[int]] | None = None) -> SchedulerOutput:
        """This tick's plan; `drafts`: guessed next tokens of decoding sequences (speculative decoding), each
        carried as far as the budget and the free cells allow."""
        drafts = drafts or {}
        plan = StepBudget()
        budget = self.max_num_batched_tokens
        wants = [s.cache_target() - s.n_cached for s in self.running]
        decoding = wants.count(1)
        prefill = self._prefill_cap(decoding, wants) if decoding else budget  # left for prefill chunks
        # Decodes first (1 token each), then unfinished prefills, by priority, oldest first.
        for seq in sorted(self.running, key=lambda s: (s.pending > 1, priority(s), s.admitted_at)):
            if seq.status is not SeqStatus.RUNNING or budget == 0:
                continue  # preempted while making room for an older sequence
            want = seq.cache_target() - seq.n_cached
            n = min(want, budget) if want == 1 else min(want, budget, prefill)
            if n > 0 and self._room_for_running(plan, seq, n):
                draft = self._draft_room(plan, drafts.get(seq), budget - n) if want == 1 else []
                plan.add(seq, n, draft)
                budget -= n + len(draft)
                prefill -= n if want > 1 else 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq in plan.preempted:
                break  # it just gave up its cells for this very step
            fresh = not seq.lookup_done
            shared = self.share_cached_prefix(seq)
            if fresh:  # once per admission, as the lookup: the disk past what the pool had
                seq.lookup_done = True
                shared = self.page_in(seq, plan.tokens) or shared
            plan.cached.append((seq, shared))
            want = seq.cache_target() - seq.n_cached
            n = min(want, budget, prefill)
            if want > 0 and n == 0:
                break  # this tick's prefill tokens are spent: it is admitted next tick
            if n > 0 and not self._room_for_waiting(plan, seq, n):
                break
            prefill -= n
            self.waiting.popleft()
            self.add_running(seq)
            if n > 0:
                plan.add(seq, n)
                budget -= n
        return SchedulerOutput(list(plan.chunks.values()), plan.cached)

    def _prefill_cap(self, decoding: int, running_wants: list[int]) -> int:
        """Prefill tokens a tick may carry beside `decoding` decodes (see __init__ for why)."""
        cap = max(self.prefill_while_decoding, decoding)
        if self.prefill_backlog_ticks > 0:
            waiting_wants = (s.cache_target() - s.n_cached for s in self.waiting)
            backlog = sum(w for w in (*running_wants, *waiting_wants) if w > 1)
            cap = max(cap, -(-backlog // self.prefill_backlog_ticks))
        return cap

    def _draft_room(self, plan: StepBudget, draft: list[int] | None, budget: int) -> list[int]:
        """As much of `draft` as fits the tick's budget and the free cells; drafts never evict or preempt
        anyone (they are a guess)."""
        if not draft:
            return []
        k = max(0, min(len(draft), budget, self.cache.free_cells() - plan.tokens - 1))
        return draft[:k]

    def _need(self, plan: StepBudget, n: int) -> int:
        return plan.tokens + n - self.cache.free_cells()

    def _room_for_running(self, plan: StepBudget, seq: Sequence, n: int) -> bool:
        while not self.cache.can_extend(plan.tokens + n):
            if self._evict_one(need=self._need(plan, n)):
                continue
            victim = max(self.running, key=lambda s: (priority(s), s.admitted_at))
            plan.drop(victim)
            plan.preempted.add(victim)
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _room_for_waiting(self, plan: StepBudget, seq: Sequence, n: int) -> bool:
        if not self.acquire_slot(seq):
            return False
        while not self.cache.can_extend(plan.tokens + n):
            if not self._evict_one(exclude=(seq,), need=self._need(plan, n)):
                return False
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)
