"""Stored responses: each one is a prefix of a persistent sequence (`server.sequences`' kind).

A stored response `R` knows its sequence and how many of its tokens are R's whole conversation
(`length`). Continuing R appends only the new turn to that sequence when R is its *tip* (nothing was
appended after R yet); continuing an older response forks the sequence at that response's length
(zero-copy). So a chain of responses shares one sequence, and a branch costs one fork.

Guarantees of `ResponseStore`:
- At most `max_stored` responses are kept; storing one more forgets the least recently used, and a
  sequence no stored response (and no running turn) refers to is returned for deletion, so the store
  never holds cells nobody can reach.
- A tip is claimed by one turn at a time (`claim_tip` is synchronous, so two concurrent continuations
  of the same response cannot both append: the second forks).
- A response whose sequence is gone (deleted, expired by `--seq-ttl`) is forgotten when next seen
  (`forget_sequence`) and is a 404 from then on; nothing ever restarts it silently from scratch.
- With `files` (`--state-dir`: `server.responses.saved.ResponseFiles`) every stored response is written
  when stored and dropped when forgotten, and a new store starts with them (least recently stored
  first); each sequence's tip is then its longest response, which a turn checks against the sequence's
  length before appending (a turn cut short by a restart leaves the sequence longer: it forks instead).
"""

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from server.errors import APIError
from server.limits import DEFAULT_MAX_STORED_RESPONSES


@dataclass(eq=False)
class Stored:
    id: str
    seq_id: str
    length: int  # tokens of the sequence that are this response's whole conversation
    parent: "Stored | None"  # the response it continued (kept alive by this reference)
    instructions: str | None
    tools: Any  # how its prompt rendered the tools (`server.generation.toolcalls.Prompting`, or None)
    inputs: list[dict]  # this turn's input messages
    reply: dict  # this turn's assistant message (content, tool_calls)
    end_token_text: str | None  # the text of the stop token the reply ended with (it is in the sequence)
    body: dict  # the response object, as GET returns it
    template_kwargs: dict | None = None  # the chat template's extra variables its prompt was rendered with
    input_items: list[dict] = field(default_factory=list)  # its request's input, as `input_items` lists it
    last_used: float = field(default_factory=time.monotonic)

    def history(self) -> list[dict]:
        """Every earlier turn, this one's input, then its reply (instructions not included)."""
        chain, node = [], self
        while node is not None:
            chain.append(node)
            node = node.parent
        out: list[dict] = []
        for node in reversed(chain):
            out += node.inputs
            out.append(node.reply)
        return out


def system(instructions: str | None) -> list[dict]:
    return [] if instructions is None else [{"role": "system", "content": instructions}]


class ResponseStore:
    def __init__(self, max_stored: int = DEFAULT_MAX_STORED_RESPONSES, files=None):
        self.max_stored = max_stored
        self.files = files  # ResponseFiles (write, drop, load) or None: memory only
        self.by_id: OrderedDict[str, Stored] = OrderedDict()
        self.refs: dict[str, set[str]] = {}  # seq id -> ids of stored responses on it
        self.tips: dict[str, str | None] = {}  # seq id -> the response that is its whole history (None: none)
        self.busy: dict[str, int] = {}  # seq id -> turns running on it
        for rec in files.load() if files is not None else ():
            self.by_id[rec.id] = rec
            self.refs.setdefault(rec.seq_id, set()).add(rec.id)
            tip = self.by_id.get(self.tips.get(rec.seq_id) or "")
            if tip is None or rec.length > tip.length:
                self.tips[rec.seq_id] = rec.id

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, response_id: str, *, param: str | None = None) -> Stored:
        """The stored response (marked used), or a 404: `previous_response_not_found` when it was named as
        `previous_response_id` (`param`), else `response_not_found`."""
        rec = self.by_id.get(response_id)
        if rec is None:
            what = "previous_response_id names" if param else "there is"
            raise APIError(404, f"{what} no stored response {response_id!r}: it was deleted, expired with its "
                           "sequence (--seq-ttl), was not stored (store: false) or never existed; send the whole "
                           "conversation as input instead", param=param,
                           code="previous_response_not_found" if param else "response_not_found")
        rec.last_used = time.monotonic()
        self.by_id.move_to_end(response_id)
        return rec

    def claim_tip(self, rec: Stored) -> bool:
        """True if `rec` is its sequence's tip and this caller may now append to it (until `release`)."""
        if self.tips.get(rec.seq_id) != rec.id:
            return False
        self.tips[rec.seq_id] = None
        return True

    def hold(self, seq_id: str) -> None:
        """A turn runs on `seq_id`: it is not deleted under it."""
        self.busy[seq_id] = self.busy.get(seq_id, 0) + 1

    def release(self, seq_id: str, *, tip: str | None = None) -> bool:
        """The turn on `seq_id` ended; `tip`: the response that is now its whole history. True if the
        sequence is no longer wanted (no stored response on it, no turn running): delete it."""
        n = self.busy.get(seq_id, 0) - 1
        if n > 0:
            self.busy[seq_id] = n
        else:
            self.busy.pop(seq_id, None)
        rec = self.by_id.get(tip) if tip is not None else None
        if rec is not None and rec.seq_id == seq_id:
            self.tips[seq_id] = tip
        return self._unwanted(seq_id)

    def add(self, rec: Stored, *, tip: bool) -> list[str]:
        """Store `rec`; returns the sequences that evictions left unwanted (delete them)."""
        self.by_id[rec.id] = rec
        self.refs.setdefault(rec.seq_id, set()).add(rec.id)
        if tip:
            self.tips[rec.seq_id] = rec.id
        if self.files is not None:
            self.files.write(rec)
        dropped = []
        while len(self.by_id) > self.max_stored:
            _, old = self.by_id.popitem(last=False)
            seq = self._unref(old)
            if seq is not None:
                dropped.append(seq)
        return dropped

    def remove(self, response_id: str) -> str | None:
        """Forget a stored response (404 if unknown); returns its sequence if nothing wants it now."""
        rec = self.get(response_id)
        del self.by_id[response_id]
        return self._unref(rec)

    def forget_sequence(self, seq_id: str) -> None:
        """The sequence is gone (expired or deleted elsewhere): its responses are gone too."""
        for rid in self.refs.pop(seq_id, set()):
            rec = self.by_id.pop(rid, None)
            if rec is not None and self.files is not None:
                self.files.drop(rec)
        self.tips.pop(seq_id, None)

    def _unref(self, rec: Stored) -> str | None:
        if self.files is not None:
            self.files.drop(rec)
        ids = self.refs.get(rec.seq_id, set())
        ids.discard(rec.id)
        if self.tips.get(rec.seq_id) == rec.id:
            self.tips[rec.seq_id] = None
        return rec.seq_id if self._unwanted(rec.seq_id) else None

    def _unwanted(self, seq_id: str) -> bool:
        if self.refs.get(seq_id) or self.busy.get(seq_id):
            return False
        self.refs.pop(seq_id, None)
        self.tips.pop(seq_id, None)
        return True
