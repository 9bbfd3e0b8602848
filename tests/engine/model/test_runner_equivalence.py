"""Cell-pool forwards equal a cacheless forward of each sequence's whole history (fp32, atol 1e-4),
for every supported architecture, both mask kinds (sdpa bool, eager additive) and every path
(reference dense window; fast compacted window through the transformers modules; fast through the
native Llama-family forward, `engine/model/native/model.py`)."""

import pytest
import torch
from tiny_models import BUILDERS, full_logits, tiny_model

from engine.model.runner import ModelRunner

ATOL = 1e-4
PATHS = [("fast", None), ("fast", False), ("reference", None)]  # (attention, native): None = native if supported
COMBOS = [(name, attn, path, native) for name in BUILDERS for attn in ("sdpa", "eager") for path, native in PATHS
          if not (name == "gpt2" and native is False)]  # gpt2 has no native forward: fast/None is fast/False


class Harness:
    """Drives a runner and keeps each sequence's token history, the oracle's input."""

    def __init__(self, name, attn, path, n_cells=128, native=None):
        self.model = tiny_model(name, attn)
        self.runner = ModelRunner(self.model, n_cells=n_cells, attention=path, native=native)
        self.cache = self.runner.cache
        self.hist: dict[int, list[int]] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Append each chunk to its sequence, run one flat step, check every sequence's last row."""
        plan_chunks = {s: (toks, self.cache.next_pos(s)) for s, toks in chunks.items()}
        out = self.runner.run(plan_chunks)
        for s, toks in chunks.items():
            self.hist.setdefault(s, []).extend(toks)
            ref = full_logits(self.model, self.hist[s])[-1]
            torch.testing.assert_close(out[s], ref, atol=ATOL, rtol=0)
        return out

    def greedy(self, seqs) -> dict[int, list[int]]:
        out = self.step({s: [self.next_token(s)] for s in seqs})
        return {s: [int(out[s].argmax())] for s in seqs}

    def next_token(self, s):
        return int(full_logits(self.model, self.hist[s])[-1].argmax())

    def fork(self, src, dst, upto=None):
        used = self.cache.free_cells()
        self.cache.seq_cp(src, dst, upto)
        assert self.cache.free_cells() == used, "a fork must not consume cells"
        self.hist[dst] = list(self.hist[src][: upto if upto is not None else len(self.hist[src])])


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 100, (n,), generator=g).tolist()


@pytest.mark.parametrize("name,attn,path,native", COMBOS)
def test_prefill_decode_batch_fork_rm_reuse(name, attn, path, native):
    h = Harness(name, attn, path, native=native)
    assert (h.runner.native is not None) == (path == "fast" and native is None and name != "gpt2")
    # 1. one sequence: prefill then 6 decode steps
    h.step({0: _prompt(9, 1)})
    for _ in range(6):
        h.step({0: [h.next_token(0)]})
    # 2. two sequences of different lengths prefilled in one forward
    h.step({1: _prompt(7, 2), 2: _prompt(12, 3)})
    # 3. batched decode continuing all
    for _ in range(3):
        h.step({s: [h.next_token(s)] for s in (0, 1, 2)})
    # 4. full fork: no cells consumed; branch decodes a different token than the trunk, both exact
    h.fork(1, 3)
    h.step({1: [h.next_token(1)], 3: [(h.next_token(1) + 1) % 100]})
    # partial fork at a position, then a suffix prefill mixed with decodes of others
    h.fork(2, 4, upto=5)
    assert h.cache.seq_len(4) == 5
    h.step({4: _prompt(6, 4), 0: [h.next_token(0)], 3: [h.next_token(3)]})
    # 5. seq_rm of the parent frees only the cells no branch still owns
    free_before, private = h.cache.free_cells(), h.cache.seq_len(1) - h.cache.shared_cells(1)
    assert h.cache.seq_rm(1) == private
    assert h.cache.free_cells() == free_before + private
    del h.hist[1]
    h.step({3: [h.next_token(3)]})
    # 6. a new sequence reuses the lowest free cells (holes) and stays exact
    h.cache.seq_rm(0)
    del h.hist[0]
    holes = torch.nonzero(h.cache.n_owners == 0).squeeze(1)[:4]
    assert int(holes[0]) < h.cache.read_len
    plan_cells = []
    orig = h.cache.begin_step

    def spy(*a, **k):
        plan = orig(*a, **k)
        plan_cells.append(plan.cells.clone())
        return plan

    h.cache.begin_step = spy
    h.step({5: _prompt(4, 5)})
    h.cache.begin_step = orig
    assert plan_cells[0].tolist() == holes.tolist()
    for s in (2, 3, 4, 5):
        h.step({s: [h.next_token(s)]})
    # removing everything empties the pool
    for s in list(h.hist):
        h.cache.seq_rm(s)
    assert h.cache.free_cells() == h.cache.n_cells and h.cache.read_len == 0


@pytest.mark.parametrize("name", list(BUILDERS))
def test_truncate_and_range_removal_stay_exact(name):
    h = Harness(name, "sdpa", "fast")
    h.step({0: _prompt(10, 7)})
    # truncate: drop positions >= 6, then continue from there
    h.cache.seq_rm(0, 6)
    h.hist[0] = h.hist[0][:6]
    assert h.cache.next_pos(0) == 6 and h.cache.seq_len(0) == 6
    h.step({0: _prompt(3, 8)})
    # range removal in the middle: those cells free and the next query no longer sees them
    # (the K/V after the hole were computed with it, so no cacheless oracle exists for the logits)
    assert h.cache.seq_rm(0, 2, 4) == 2
    assert h.cache.seq_len(0) == 7 and h.cache.seq_positions(0).tolist() == [0, 1, 4, 5, 6, 7, 8]
    plan = h.cache.begin_step([0], [9])
    seen = plan.key_pos[plan.visible[0]].sort().values.tolist()
    h.cache.abort_step()
    assert seen == [0, 1, 4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("path,native", PATHS)
def test_both_paths_agree_with_idle_cells(path, native):
    """Many idle cells below the active sequences: the fast path must skip them and still agree."""
    h = Harness("llama_gqa", "sdpa", path, n_cells=256, native=native)
    h.step({9: _prompt(100, 11)})  # an idle sequence holding 100 low cells
    h.step({0: _prompt(5, 12), 1: _prompt(6, 13)})
    for _ in range(3):
        h.step({0: [h.next_token(0)], 1: [h.next_token(1)]})
    plan = h.cache.begin_step([0], [h.cache.next_pos(0)])
    h.cache.abort_step()
    if path == "fast":
        assert plan.read_idx is not None and plan.read_idx.numel() == h.cache.seq_len(0) + 1
    else:
        assert plan.read_idx is None


@pytest.mark.parametrize("name,native", [(name, native) for name in BUILDERS for native in (None, False)
                                         if not (name == "gpt2" and native is False)])
def test_greedy_32_tokens_equals_generate(name, native):
    model = tiny_model(name)
    runner = ModelRunner(model, n_cells=128, native=native)
    prompt = _prompt(8, 21)
    ids, pos = list(prompt), 0
    chunk = prompt
    for _ in range(32):
        logits = runner.run({0: (chunk, pos)})[0]
        pos += len(chunk)
        chunk = [int(logits.argmax())]
        ids += chunk
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                             min_new_tokens=32, pad_token_id=0)
    assert ids == ref[0].tolist()


class _Boom:
    def __getattr__(self, name):
        raise RuntimeError("injected")

    def __call__(self, *args):
        raise RuntimeError("injected")


@pytest.mark.parametrize("native", [False, True])
def test_failed_forward_releases_its_cells(native):
    model = tiny_model("llama_gqa")
    runner = ModelRunner(model, n_cells=64, native=native)
    runner.run({0: (_prompt(5, 1), 0)})
    free, read_len = runner.cache.free_cells(), runner.cache.read_len
    with pytest.MonkeyPatch.context() as mp:  # layer 1 fails mid-forward, after layer 0 wrote its K/V
        if native:
            mp.setattr(runner.native.layers[1], "mlp", _Boom())
        else:
            mp.setattr(model.model.layers[1], "forward", _raise)
        with pytest.raises(RuntimeError, match="injected"):
            runner.run({0: ([1, 2], 5), 1: (_prompt(9, 2), 0)})
    assert runner.cache.free_cells() == free and runner.cache.read_len == read_len
    assert runner.cache.plan is None
    out = runner.run({0: ([7], 5)})[0]  # still exact after the failure
    torch.testing.assert_close(out, full_logits(model, _prompt(5, 1) + [7])[-1], atol=ATOL, rtol=0)


def _raise(*args, **kwargs):
    raise RuntimeError("injected")


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_sliding", "gpt2"])
def test_row_gather_kernel_is_used_for_many_decodes_and_exact(name):
    from engine.model import hf_attention as attention

    h = Harness(name, "sdpa", "fast", n_cells=256, native=False)
    assert h.model.config._attn_implementation == attention.GATHER
    for s in range(8):
        h.step({s: _prompt(6 + s, 30 + s)})
    calls = []
    orig = attention.cell_gather_attention

    def spy(*args, cell_rows=None, **kwargs):
        calls.append(cell_rows)
        return orig(*args, cell_rows=cell_rows, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(attention.AttentionInterface._global_mapping, attention.GATHER, spy)
        for _ in range(3):
            h.step({s: [h.next_token(s)] for s in range(8)})
    gathered = [c for c in calls if c is not None]  # the oracle's cacheless forwards pass no rows
    assert len(gathered) == 3 * h.model.config.num_hidden_layers, "8 decodes should take the gather path"
    assert gathered[-1].idx.shape[0] == 8 and gathered[-1].idx.shape[1] <= 16
