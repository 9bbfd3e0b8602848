"""PrefixIndex: which holders have cells for which token prefixes.

Automatic prefix sharing. Every sequence with cells holds positions `[0, n_cached)` of its token ids
(see `Sequence`), and a cell may be owned by many sequences. So a new sequence whose tokens start like
a holder's can share the holder's cells for the common prefix with one `seq_cp` (no copy, no
recompute) and prefill only the rest, at token granularity. Holders are running sequences, idle
persistent ones, and *cached* ones: finished requests whose cells are kept (status FINISHED, still
holding a slot) until eviction. `PrefixIndex` finds the longest shared prefix without comparing the
new tokens against every holder: each holder is registered under the chained hashes of its full
`BLOCK`-token blocks of cached tokens (hash i covers tokens `[0, (i+1) * BLOCK)`); a lookup walks the
new tokens' chain while some holder has the block, checks the tokens themselves (hash collisions are
harmless), then extends the match token by token into the next, partial block. Registration follows
`n_cached` in both directions, so a holder is never found for cells it no longer has. `longest()`
never returns more than `limit` tokens nor more than the holder has cached, and the returned holder's
token ids equal the query on the whole match. A chain starts from the holder's LoRA adapter (`_root`),
so cells computed under one adapter are found only by sequences under the same one, the base's by the base's. The index costs work only when a sequence's `n_cached`
crosses a block boundary (amortised O(1/BLOCK) per decoded token).
"""

import sys
from dataclasses import dataclass

from engine.api.lora import LoraBinding
from engine.core.sequence import Sequence

BLOCK = 16
MAX_EXTEND_CANDIDATES = 8  # holders of the deepest block tried for the token-level extension


@dataclass
class PrefixStats:
    queried_tokens: int = 0  # prompt tokens looked up (each admission of a sequence with no cells)
    hit_tokens: int = 0  # of those, tokens whose cells were shared instead of prefilled


class PrefixIndex:
    """Chained block hashes -> the sequences holding cells for that whole prefix."""

    def __init__(self):
        self._holders: dict[int, dict[Sequence, None]] = {}  # insertion-ordered sets
        self._blocks: dict[Sequence, list[int]] = {}  # each registered sequence's chain
        self.stats = PrefixStats()

    def update(self, seq: Sequence) -> None:
        """Make `seq`'s registration match its cells: exactly its first `n_cached // BLOCK` blocks."""
        want = seq.n_cached // BLOCK if seq.slot is not None else 0
        chain = self._blocks.get(seq)
        have = len(chain) if chain is not None else 0
        if want == have:
            return
        if chain is None:
            chain = self._blocks[seq] = []
        while len(chain) > want:
            h = chain.pop()
            holders = self._holders[h]
            del holders[seq]
            if not holders:
                del self._holders[h]
        tokens = seq.token_ids
        while len(chain) < want:
            i = len(chain)
            h = hash((chain[-1] if chain else _root(seq.lora), tuple(tokens[i * BLOCK:(i + 1) * BLOCK])))
            chain.append(h)
            self._holders.setdefault(h, {})[seq] = None
        if not chain:
            del self._blocks[seq]

    def forget(self, seq: Sequence) -> None:
        """`seq` holds no cells any more (released) or is gone."""
        chain = self._blocks.pop(seq, None)
        for h in chain or ():
            holders = self._holders[h]
            del holders[seq]
            if not holders:
                del self._holders[h]

    def longest(self, tokens: list[int], limit: int, lora: LoraBinding | None = None) -> tuple[Sequence | None, int]:
        """The holder under adapter `lora` (None: the base) sharing the longest prefix of `tokens` (at most
        `limit` tokens) and its length."""
        prev, depth, holders = _root(lora), 0, None
        for i in range(limit // BLOCK):
            h = hash((prev, tuple(tokens[i * BLOCK:(i + 1) * BLOCK])))
            found = self._holders.get(h)
            if not found:
                break
            prev, depth, holders = h, i + 1, found
        if holders is None:
            return None, 0
        base = depth * BLOCK
        best, best_len = None, 0
        for seq in list(holders)[:MAX_EXTEND_CANDIDATES]:
            if seq.lora != lora or seq.token_ids[:base] != tokens[:base]:  # a hash collision: not a real match
                continue
            end = min(limit, seq.n_cached)
            m = base
            while m < end and seq.token_ids[m] == tokens[m]:
                m += 1
            if m > best_len:
                best, best_len = seq, m
        return best, best_len

    def __len__(self) -> int:
        return len(self._blocks)

    def footprint(self) -> int:
        """Bytes the index's own tables take (dicts, chains and holder sets; the sequences are not its)."""
        size = sys.getsizeof(self._holders) + sys.getsizeof(self._blocks)
        size += sum(sys.getsizeof(chain) + 32 * len(chain) for chain in list(self._blocks.values()))  # + the hashes
        return size + sum(sys.getsizeof(h) for h in list(self._holders.values()))


def _root(lora: LoraBinding | None) -> int:
    """Where a chain of block hashes starts: cells computed under an adapter (and scale) are found only by
    sequences under the same one (K/V belong to the weights that computed them), the base's by the base's."""
    return 0 if lora is None else hash(("lora", lora))
