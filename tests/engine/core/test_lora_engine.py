"""LoRA adapters through the engine: each request's greedy tokens are its own model's (PEFT merged, a cacheless
argmax loop) whatever shares its steps, through n > 1 forks, persistent forks and the prefix cache, whose
cells are shared only within one adapter (engine/core/adapters.py, engine/core/prefix_index.py)."""

import pytest
from engine_support import (
    Collector,
    check_cells_match_sequences,
    drain,
    greedy,
    greedy_oracle,
    make_engine,
    prompt,
)
from lora_support import ATTN, peft_adapter
from tiny_models import tiny_model

from engine.api.lora import AdapterBusy, AdapterNotFound, LoraRef


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapters of the tiny Llama and the three oracles: {None: base, "a": r 8 all linears, "b": r 16 attention}."""
    base = tiny_model("llama_gqa")
    folder = tmp_path_factory.mktemp("adapters")
    pa, ma = peft_adapter(base, folder / "a", r=8, seed=1)
    pb, mb = peft_adapter(base, folder / "b", r=16, targets=ATTN, seed=2)
    return {"a": pa, "b": pb}, {None: base, "a": ma, "b": mb}


def _engine(paths, **kw):
    eng = make_engine("llama_gqa", **kw)
    for name, path in paths.items():
        eng.adapters.load(name, path)
    return eng


def _ref(name):
    return LoraRef(name) if name else None


def test_mixed_adapters_in_flight_each_get_their_own_greedy_tokens(adapters):
    paths, oracles = adapters
    eng = _engine(paths)
    names = [None, "a", "b", "a", None, "b"]
    prompts = [prompt(6 + 5 * i, i) for i in range(len(names))]
    outs = []
    for i, (name, ids) in enumerate(zip(names, prompts)):
        outs.append(Collector())
        eng.add_request(f"r{i}", ids, greedy(8, lora=_ref(name), n=2 if i == 1 else 1), outs[-1])
    while eng.has_unfinished():
        eng.step()
        check_cells_match_sequences(eng)
    for name, ids, out in zip(names, prompts, outs):
        want = greedy_oracle(oracles[name], ids, 8)
        assert all(out.tokens[i] == want for i in out.tokens), (name, out.tokens, want)
    assert len(outs[1].tokens) == 2  # the n = 2 fork children ran under the adapter too


def test_prefix_cells_are_shared_only_within_one_adapter(adapters):
    paths, oracles = adapters
    eng = _engine(paths)
    ids = prompt(40, 7)
    seen = {}
    for i, name in enumerate([None, "a", "a", "b", None]):
        out = Collector()
        eng.add_request(f"p{i}", ids, greedy(5, lora=_ref(name)), out)
        drain(eng)
        assert out.tokens[0] == greedy_oracle(oracles[name], ids, 5), name
        seen[i] = out.deltas[-1].cached_tokens
    # the first of each kind computes the prompt; a repeat under the same adapter (or the base) reuses it
    assert seen[0] == 0 and seen[1] == 0 and seen[3] == 0
    assert seen[2] >= 32 and seen[4] >= 32


def test_a_persistent_sequence_keeps_its_adapter_and_a_fork_inherits_it(adapters):
    paths, oracles = adapters
    eng = _engine(paths)
    ids = prompt(20, 3)
    seq, _ = eng.create_sequence(ids, lora=LoraRef("a"))
    drain(eng)
    out = Collector()
    eng.add_request("c1", [], greedy(4), out, seq_id=seq.seq_id)  # names no adapter: the sequence's own
    drain(eng)
    hist = ids + out.tokens[0]
    assert out.tokens[0] == greedy_oracle(oracles["a"], ids, 4)
    child = eng.fork(seq.seq_id)
    out = Collector()
    eng.add_request("c2", [5, 6], greedy(4), out, seq_id=child.seq_id)
    drain(eng)
    assert out.tokens[0] == greedy_oracle(oracles["a"], hist + [5, 6], 4)
    other = eng.fork(seq.seq_id, lora=LoraRef("b"))  # a fork under another adapter: recomputed under it
    assert other.lora.name == "b" and other.n_cached == 0
    out = Collector()
    eng.add_request("c4", [], greedy(3), out, seq_id=other.seq_id)
    drain(eng)
    assert out.tokens[0] == greedy_oracle(oracles["b"], hist, 3)
    with pytest.raises(AdapterNotFound):
        eng.fork(seq.seq_id, lora=LoraRef("zzz"))
    out = Collector()  # naming another adapter: from now on under it, the history recomputed
    eng.add_request("c3", [], greedy(3, lora=LoraRef("b")), out, seq_id=seq.seq_id)
    drain(eng)
    assert out.tokens[0] == greedy_oracle(oracles["b"], hist, 3)


def test_names_ids_unknown_adapters_and_unloading(adapters):
    paths, oracles = adapters
    eng = _engine(paths)
    ids = prompt(18, 5)
    with pytest.raises(AdapterNotFound, match="no LoRA adapter named 'zzz'.*loaded: a, b"):
        eng.add_request("x", ids, greedy(2, lora=LoraRef("zzz")))
    with pytest.raises(AdapterNotFound, match="id 7"):
        eng.add_request("x", ids, greedy(2, lora=LoraRef(id=7)))
    assert not eng.requests and not eng.scheduler.waiting  # refused: nothing changed
    outs = [Collector() for _ in range(3)]
    eng.add_request("m", ids, greedy(3, lora=LoraRef("some-served-name", by_model=True)), outs[0])  # the base
    eng.add_request("i", ids, greedy(3, lora=LoraRef(id=1)), outs[1])  # llama.cpp's id: "b"
    with pytest.raises(AdapterBusy):
        eng.adapters.unload("b")
    drain(eng)
    assert outs[0].tokens[0] == greedy_oracle(oracles[None], ids, 3)
    assert outs[1].tokens[0] == greedy_oracle(oracles["b"], ids, 3)
    cached = [s for s in eng.scheduler.holders.values() if s.lora is not None]
    assert cached  # "b"'s finished request left its cells as a cached prefix
    eng.adapters.unload("b")
    assert not [s for s in eng.scheduler.holders.values() if s.lora is not None]  # its cells went with it
    with pytest.raises(AdapterNotFound):
        eng.add_request("y", ids, greedy(2, lora=LoraRef("b")))
    eng.adapters.load("b", paths["b"])  # again: a new load, a new id
    eng.add_request("z", ids, greedy(3, lora=LoraRef("b")), outs[2])
    drain(eng)
    assert outs[2].tokens[0] == greedy_oracle(oracles["b"], ids, 3)
    assert [i.name for i in eng.adapters.infos()] == ["a", "b"] and eng.adapters.infos()[1].id == 2


def test_a_durable_sequence_records_its_adapter_and_never_saves_its_cells(adapters, tmp_path):
    """With a state dir, a sequence under an adapter comes back under it (by name) after a restart, recomputed:
    its cells are never written where a sequence of the same tokens under the base could load them."""
    paths, oracles = adapters
    ids = prompt(40, 9)
    first = _engine(paths, state_dir=tmp_path)
    seq, _ = first.create_sequence(ids, lora=LoraRef("a"))
    drain(first)
    base_seq, _ = first.create_sequence(ids)  # the same tokens under the base: its cells are saved
    drain(first)
    first.save_sequence(seq.seq_id)
    first.save_sequence(base_seq.seq_id)
    second = _engine(paths, state_dir=tmp_path)
    restored = second.sequences[seq.seq_id]
    assert restored.lora is not None and restored.lora.name == "a" and restored.n_cached == 0
    out = Collector()
    second.add_request("c", [], greedy(4), out, seq_id=seq.seq_id)
    drain(second)
    assert out.tokens[0] == greedy_oracle(oracles["a"], ids, 4)
    out = Collector()  # the base sequence's saved cells serve the base
    second.add_request("d", [], greedy(4), out, seq_id=base_seq.seq_id)
    drain(second)
    assert out.tokens[0] == greedy_oracle(oracles[None], ids, 4)


def test_preempted_adapter_requests_resume_under_their_adapter(adapters):
    """A pool too small for all of them: requests are preempted (cells dropped) and re-prefill under their own
    adapter, each ending with its own model's tokens."""
    paths, oracles = adapters
    eng = _engine(paths, n_cells=64)
    names = ["a", None, "b", "a"]
    prompts = [prompt(20, 20 + i) for i in range(len(names))]
    outs = []
    for i, (name, ids) in enumerate(zip(names, prompts)):
        outs.append(Collector())
        eng.add_request(f"q{i}", ids, greedy(12, lora=_ref(name)), outs[-1])
    drain(eng)
    assert eng.scheduler.preemptions > 0
    for name, ids, out in zip(names, prompts, outs):
        assert out.tokens[0] == greedy_oracle(oracles[name], ids, 12), name
