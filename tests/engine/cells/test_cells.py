"""CellCache contract: admission, misuse, and a random-interleaving property test.

- Admission (`CacheFull`) is decided in `begin_step` before any cell is claimed, and `can_extend` agrees.
- Every misuse raises `CellCacheError` and leaves the cache exactly as it was (free count, `owner`,
  `n_owners`, `pos`, `read_len`, the plan in progress).
- A hypothesis state machine interleaves new / prefill / decode / fork (full, partial) / truncate /
  remove over several slots on tiny models, both attention paths, and checks after every operation that
  each sequence's logits equal a cacheless forward over its whole history, and that the pool's
  accounting matches a shadow model that names every written cell.
"""

import functools
import itertools

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tiny_models import VOCAB, full_logits, tiny_model

from engine.cells.cache import DEFAULT_MAX_SEQS, CacheFull, CellCache, CellCacheError
from engine.model.runner import ModelRunner

ATOL = 1e-4


def snapshot(cache: CellCache) -> dict:
    """Everything a failed call must leave untouched."""
    return {
        "owner": cache.owner.clone(),
        "n_owners": cache.n_owners.clone(),
        "pos": cache.pos.clone(),
        "read_len": cache.read_len,
        "free": cache.free_cells(),
        "plan": cache.plan,
    }


def assert_unchanged(cache: CellCache, before: dict) -> None:
    after = snapshot(cache)
    for key in ("owner", "n_owners", "pos"):
        assert torch.equal(after[key], before[key]), f"{key} changed"
    assert after["read_len"] == before["read_len"]
    assert after["free"] == before["free"]
    assert after["plan"] is before["plan"], "the step in progress changed"


def fill(cache: CellCache, seq_ids, positions) -> None:
    """Claim cells for tokens without a model (metadata only: no layer runs, the pools stay unallocated)."""
    cache.begin_step(seq_ids, positions)
    cache.end_step()


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


# ----- 7. admission ---------------------------------------------------------------------------
def full_pool_with_holes() -> CellCache:
    """12 cells: seq 0 in cells 0-5, seq 1 in cells 6-11, then seq 0's positions 2 and 3 removed (2 holes)."""
    cache = CellCache(n_cells=12, n_layers=2, max_seqs=8)
    fill(cache, [0] * 6 + [1] * 6, list(range(6)) * 2)
    assert cache.free_cells() == 0 and not cache.can_extend(1)
    assert cache.seq_rm(0, 2, 4) == 2
    return cache


def test_cache_full_is_raised_before_anything_is_claimed():
    cache = full_pool_with_holes()
    assert cache.free_cells() == 2 and cache.read_len == 12
    assert cache.can_extend(2) and not cache.can_extend(3)
    before = snapshot(cache)
    with pytest.raises(CacheFull) as err:
        cache.begin_step([2, 2, 3], [0, 1, 0])
    assert (err.value.needed, err.value.free) == (3, 2)
    assert isinstance(err.value, CellCacheError)
    assert_unchanged(cache, before)
    assert cache.seq_len(2) == 0 and cache.seq_len(3) == 0
    # what can_extend admits always fits, and lands in the holes
    plan = cache.begin_step([2, 3], [0, 0])
    assert plan.cells.tolist() == [2, 3]
    cache.end_step()
    assert cache.free_cells() == 0 and cache.can_extend(0) and not cache.can_extend(1)
    with pytest.raises(CacheFull) as err:
        cache.begin_step([2], [1])
    assert (err.value.needed, err.value.free) == (1, 0)


def test_runner_admission_failure_leaves_cache_usable_and_exact():
    model = tiny_model("llama_gqa")
    runner = ModelRunner(model, n_cells=16, attention="fast")
    cache = runner.cache
    p0 = _prompt(10, 1)
    runner.run({0: (p0, 0)})
    before = snapshot(cache)
    assert not cache.can_extend(7)
    with pytest.raises(CacheFull) as err:
        runner.run({0: ([5], 10), 1: (_prompt(6, 2), 0)})
    assert (err.value.needed, err.value.free) == (7, 6)
    assert_unchanged(cache, before)
    assert cache.plan is None
    # exactly the free count fits, and the results are still exact
    p1 = _prompt(5, 3)
    out = runner.run({0: ([5], 10), 1: (p1, 0)})
    assert cache.free_cells() == 0
    torch.testing.assert_close(out[0], full_logits(model, p0 + [5])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], full_logits(model, p1)[-1], atol=ATOL, rtol=0)


# ----- 8. misuse ------------------------------------------------------------------------------
MAX = 8
BAD_SLOTS = [-1, -MAX, MAX, MAX + 1, 2**63, True, False, 1.0, "0", None]


@pytest.fixture
def cache() -> CellCache:
    """A small pool in a non-trivial state: two sequences, a partial fork, a hole."""
    cache = CellCache(n_cells=16, n_layers=2, max_seqs=MAX)
    fill(cache, [0] * 5 + [1] * 4, list(range(5)) + list(range(4)))
    cache.seq_cp(0, 2, upto=3)
    cache.seq_rm(1, 1, 2)
    return cache


def _slot_misuses():
    for bad in BAD_SLOTS:
        yield f"seq_len({bad!r})", lambda c, b=bad: c.seq_len(b), "seq_id"
        yield f"next_pos({bad!r})", lambda c, b=bad: c.next_pos(b), "seq_id"
        yield f"shared_cells({bad!r})", lambda c, b=bad: c.shared_cells(b), "seq_id"
        yield f"seq_positions({bad!r})", lambda c, b=bad: c.seq_positions(b), "seq_id"
        yield f"seq_rm({bad!r})", lambda c, b=bad: c.seq_rm(b), "seq_id"
        yield f"seq_cp(src={bad!r})", lambda c, b=bad: c.seq_cp(b, 3), "src"
        yield f"seq_cp(dst={bad!r})", lambda c, b=bad: c.seq_cp(0, b), "dst"
    for bad in (-1, MAX, MAX + 100):
        yield f"begin_step([{bad}])", lambda c, b=bad: c.begin_step([b], [0]), "out of range"
        yield f"begin_step([3, {bad}])", lambda c, b=bad: c.begin_step([3, b], [0, 0]), "out of range"


STEP_MISUSES = [
    ("empty step", lambda c: c.begin_step([], []), "empty step"),
    ("empty tensors", lambda c: c.begin_step(torch.zeros(0), torch.zeros(0)), "empty step"),
    ("more seq_ids than positions", lambda c: c.begin_step([3, 3], [0]), "2 seq_ids but 1 positions"),
    ("more positions than seq_ids", lambda c: c.begin_step([3], [0, 1]), "1 seq_ids but 2 positions"),
    ("negative position", lambda c: c.begin_step([3, 3], [0, -1]), "negative position"),
    ("position already held", lambda c: c.begin_step([3, 0], [0, 4]), "seq 0 already holds position 4"),
    ("position held through a fork", lambda c: c.begin_step([2], [1]), "seq 2 already holds position 1"),
    ("(seq, pos) repeated in the step", lambda c: c.begin_step([3, 4, 3], [7, 7, 7]), "repeats"),
    ("seq_rm p0 < 0", lambda c: c.seq_rm(0, -1), "invalid"),
    ("seq_rm p1 < p0", lambda c: c.seq_rm(0, 3, 2), "invalid"),
    ("seq_rm p1 < 0", lambda c: c.seq_rm(0, 0, -1), "invalid"),
    ("take_layer without a step", lambda c: c.take_layer(0), "forward without a step"),
]

MISUSES = list(_slot_misuses()) + STEP_MISUSES


@pytest.mark.parametrize("call,match", [m[1:] for m in MISUSES], ids=[m[0] for m in MISUSES])
def test_misuse_raises_and_changes_nothing(cache, call, match):
    before = snapshot(cache)
    with pytest.raises(CellCacheError, match=match):
        call(cache)
    assert_unchanged(cache, before)


def test_a_free_hole_position_may_be_refilled(cache):
    """The contrast to 'position already held': seq 1 dropped position 1, so claiming it again is legal."""
    assert cache.seq_positions(1).tolist() == [0, 2, 3]
    fill(cache, [1], [1])
    assert cache.seq_positions(1).tolist() == [0, 1, 2, 3]


def test_step_while_another_is_in_progress(cache):
    baseline = snapshot(cache)
    plan = cache.begin_step([3], [0])
    during = snapshot(cache)
    with pytest.raises(CellCacheError, match="already in progress"):
        cache.begin_step([4], [0])
    assert_unchanged(cache, during)
    assert cache.plan is plan
    cache.abort_step()
    assert_unchanged(cache, baseline)


def test_layer_served_twice_in_one_step(cache):
    cache.begin_step([3, 3], [0, 1])
    assert cache.take_layer(0) is cache.plan
    during = snapshot(cache)
    with pytest.raises(CellCacheError, match="layer 0 served twice"):
        cache.take_layer(0)
    assert_unchanged(cache, during)
    assert cache.take_layer(1) is cache.plan  # the other layer is still served once
    cache.end_step()
    with pytest.raises(CellCacheError, match="forward without a step"):
        cache.take_layer(0)  # after end_step the plan is gone


def test_layer_update_twice_in_one_step(cache):
    """Through the transformers entry point: a layer whose update runs twice in a step is refused."""
    plan = cache.begin_step([3, 3], [0, 1])
    k, v = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    keys, _ = cache.update(k, v, 0)
    assert keys.shape[2] == plan.visible.shape[1]  # the read window this step's mask describes
    during = snapshot(cache)
    with pytest.raises(CellCacheError, match="served twice"):
        cache.update(k, v, 0)
    assert_unchanged(cache, during)
    cache.abort_step()


def test_model_forward_without_a_step_is_refused():
    model = tiny_model("llama_gqa")
    runner = ModelRunner(model, n_cells=32)
    runner.run({0: (_prompt(4, 1), 0)})
    before = snapshot(runner.cache)
    with pytest.raises(CellCacheError, match="forward without a step"), torch.inference_mode():
        model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[4]]), use_cache=True,
              **{runner._cache_kwarg: runner.cache})
    assert_unchanged(runner.cache, before)


def test_max_seqs_default_and_beyond_63():
    assert DEFAULT_MAX_SEQS >= 256
    assert CellCache(n_cells=4, n_layers=1).max_seqs >= 256
    model = tiny_model("llama_gqa")
    assert ModelRunner(model, n_cells=8).cache.max_seqs >= 256
    runner = ModelRunner(model, n_cells=32, max_seqs=300)
    cache = runner.cache
    a, b = _prompt(6, 1), _prompt(3, 2)
    out = runner.run({299: (a, 0), 64: (b, 0)})
    torch.testing.assert_close(out[299], full_logits(model, a)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[64], full_logits(model, b)[-1], atol=ATOL, rtol=0)
    cache.seq_cp(299, 298, upto=4)
    assert cache.seq_len(298) == 4 and cache.shared_cells(299) == 4 and cache.next_pos(299) == 6
    out = runner.run({298: ([7], 4), 299: ([8], 6)})
    torch.testing.assert_close(out[298], full_logits(model, a[:4] + [7])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[299], full_logits(model, a + [8])[-1], atol=ATOL, rtol=0)
    before = snapshot(cache)
    for call in (lambda: cache.seq_len(300), lambda: cache.seq_cp(299, 300), lambda: cache.begin_step([300], [0])):
        with pytest.raises(CellCacheError, match="300"):
            call()
    assert_unchanged(cache, before)
    for s in (299, 298, 64):
        cache.seq_rm(s)
    assert cache.free_cells() == 32 and cache.read_len == 0


# ----- 9. property test: random interleavings ---------------------------------------------------
@functools.cache
def _model(name):
    return tiny_model(name)


class CellMachine(RuleBasedStateMachine):
    """Drives a ModelRunner with random operations against a shadow model.

    The shadow keeps, per slot, its token history as `(token, cell_name)` pairs: every token written
    gets a fresh name, forks copy names, truncation and removal drop them. Cells in use must then equal
    the number of distinct names, and a sequence's shared cells the names another slot also holds.
    Only suffix truncation and whole removal are used: after a middle removal no cacheless oracle exists.
    """

    NAME, PATH = "llama_gqa", "fast"
    N_CELLS, SLOTS, MAX_LEN = 24, 5, 20

    def __init__(self):
        super().__init__()
        self.model = _model(self.NAME)
        self.runner = ModelRunner(self.model, n_cells=self.N_CELLS, max_seqs=self.SLOTS, attention=self.PATH)
        self.cache = self.runner.cache
        self.hist: dict[int, list[tuple[int, int]]] = {}
        self.names = itertools.count()

    # -- helpers
    def free_slots(self):
        return [s for s in range(self.SLOTS) if s not in self.hist]

    def private(self, s, start=0) -> int:
        """Cells only `s` holds among its history from `start`: what removing them must free."""
        others = {n for t, hs in self.hist.items() if t != s for _, n in hs}
        return sum(n not in others for _, n in self.hist[s][start:])

    # -- rules
    @rule(data=st.data())
    def step(self, data):
        """One flat step: at most one new sequence's prefill, mixed with prefill continuations and
        1-token decodes of existing ones, in random order. If it cannot fit, `CacheFull` changes nothing."""
        new = data.draw(st.none() | st.sampled_from(self.free_slots())) if self.free_slots() else None
        chunks = {}
        for s in data.draw(st.permutations(range(self.SLOTS))):
            have = len(self.hist.get(s, []))
            if s != new and not have:
                continue
            room = min(6 if s == new else 4, self.MAX_LEN - have)
            n = data.draw(st.integers(1 if s == new else 0, room)) if room else 0
            if n:
                chunks[s] = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
        if not chunks:
            return
        needed = sum(map(len, chunks.values()))
        if not self.cache.can_extend(needed):
            before = snapshot(self.cache)
            with pytest.raises(CacheFull) as err:
                self.runner.run({s: (toks, len(self.hist.get(s, []))) for s, toks in chunks.items()})
            assert (err.value.needed, err.value.free) == (needed, before["free"])
            assert_unchanged(self.cache, before)
            return
        out = self.runner.run({s: (toks, len(self.hist.get(s, []))) for s, toks in chunks.items()})
        for s, toks in chunks.items():
            self.hist.setdefault(s, []).extend((t, next(self.names)) for t in toks)
            ref = full_logits(self.model, [t for t, _ in self.hist[s]])[-1]
            torch.testing.assert_close(out[s], ref, atol=ATOL, rtol=0)

    @precondition(lambda self: self.hist and len(self.hist) < self.SLOTS)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(sorted(self.hist)))
        dst = data.draw(st.sampled_from(self.free_slots()))
        n = len(self.hist[src])
        upto = data.draw(st.integers(1, n + 2))  # < n: partial; n: all; n + 1: None (all); n + 2: beyond
        upto = None if upto == n + 1 else upto
        free = self.cache.free_cells()
        self.cache.seq_cp(src, dst, upto)
        assert self.cache.free_cells() == free, "a fork must not consume cells"
        self.hist[dst] = list(self.hist[src][:upto])

    @precondition(lambda self: any(len(h) > 1 for h in self.hist.values()))
    @rule(data=st.data())
    def truncate(self, data):
        s = data.draw(st.sampled_from(sorted(s for s, h in self.hist.items() if len(h) > 1)))
        p = data.draw(st.integers(1, len(self.hist[s]) - 1))
        p1 = data.draw(st.none() | st.integers(len(self.hist[s]), self.MAX_LEN + 5))
        expect = self.private(s, p)
        assert self.cache.seq_rm(s, p, p1) == expect
        self.hist[s] = self.hist[s][:p]

    @precondition(lambda self: self.hist)
    @rule(data=st.data())
    def remove(self, data):
        s = data.draw(st.sampled_from(sorted(self.hist)))
        expect = self.private(s)
        assert self.cache.seq_rm(s) == expect
        del self.hist[s]

    # -- invariants, checked after every rule
    @invariant()
    def accounting(self):
        c = self.cache
        in_use = c.owner.any(0)
        assert torch.equal(c.n_owners, c.owner.sum(0).to(c.n_owners.dtype))
        assert c.free_cells() + int(in_use.sum()) == c.n_cells
        assert int(in_use.sum()) == len({n for hs in self.hist.values() for _, n in hs})
        occupied = torch.nonzero(in_use)
        assert c.read_len == (int(occupied[-1]) + 1 if occupied.numel() else 0)
        assert bool((c.pos[~in_use] == -1).all())
        assert c.plan is None

    @invariant()
    def sequences(self):
        for s in range(self.SLOTS):
            h = self.hist.get(s, [])
            assert self.cache.seq_len(s) == len(h)
            assert self.cache.next_pos(s) == len(h)
            assert self.cache.seq_positions(s).tolist() == list(range(len(h)))
            if h:
                assert self.cache.shared_cells(s) == len(h) - self.private(s)

    def teardown(self):
        for s in list(self.hist):
            self.cache.seq_rm(s)
        assert self.cache.free_cells() == self.cache.n_cells and self.cache.read_len == 0
        assert not self.cache.owner.any() and not self.cache.n_owners.any()


# No shrink phase: shrinking these programs can take minutes on a 2-core box; a failure still prints
# the whole failing program (at most 12 steps). Add Phase.shrink locally to minimise one.
SETTINGS = settings(max_examples=30, stateful_step_count=12, deadline=None,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _machine(name: str, path: str):
    machine = type(f"CellMachine_{name}_{path}", (CellMachine,), {"NAME": name, "PATH": path})
    case = machine.TestCase
    case.settings = SETTINGS
    return case


TestInterleavingsLlamaFast = _machine("llama_gqa", "fast")
TestInterleavingsLlamaReference = _machine("llama_gqa", "reference")
TestInterleavingsQwenSlidingFast = _machine("qwen2_sliding", "fast")
TestInterleavingsQwenSlidingReference = _machine("qwen2_sliding", "reference")


def test_fork_and_remove_are_refused_during_a_step():
    from engine.cells.cache import CellCache, CellCacheError

    cache = CellCache(8, 1)
    cache.begin_step([0], [0])
    with pytest.raises(CellCacheError, match="during a step"):
        cache.seq_cp(0, 1)
    with pytest.raises(CellCacheError, match="during a step"):
        cache.seq_rm(0)
    cache.abort_step()
    assert cache.free_cells() == 8 and not cache.owner.any()


@pytest.mark.parametrize("seq_ids,positions", [([True], [0]), ([0.9], [1]), ([0], [1.7])])
def test_begin_step_refuses_bool_and_float_ids(seq_ids, positions):
    from engine.cells.cache import CellCache, CellCacheError

    cache = CellCache(8, 1)
    with pytest.raises(CellCacheError, match="must be integers"):
        cache.begin_step(seq_ids, positions)
    assert cache.free_cells() == 8 and cache.plan is None
