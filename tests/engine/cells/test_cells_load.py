"""`CellCache.seq_read` / `seq_load`: K/V read out of the pool in position order come back into another pool
(or another slot) exactly, and the next forward over them gives the logits of a full recompute."""

import pytest
import torch
from tiny_models import full_logits, tiny_model

from engine.cells.cache import CacheFull, CellCache, CellCacheError
from engine.model.runner import ModelRunner


def _prefilled(model, ids, n_cells=64):
    runner = ModelRunner(model, n_cells=n_cells, max_seqs=4)
    runner.run({0: (ids[:-1], 0)})
    return runner


def test_read_then_load_reproduces_the_next_token_logits():
    model = tiny_model("llama_gqa")
    ids = list(range(5, 25))
    src = _prefilled(model, ids)
    keys, values = src.cache.seq_read(0, 0, len(ids) - 1)
    assert keys.shape[:3] == (len(src.cache.layers), keys.shape[1], len(ids) - 1)

    dst = ModelRunner(model, n_cells=64, max_seqs=4)  # fresh pools: seq_load allocates them
    dst.cache.seq_load(2, 0, keys[:, :, :7], values[:, :, :7])  # in two pieces, as chunks load
    dst.cache.seq_load(2, 7, keys[:, :, 7:], values[:, :, 7:])
    assert dst.cache.seq_positions(2).tolist() == list(range(len(ids) - 1))
    assert torch.equal(dst.cache.seq_read(2, 0, len(ids) - 1)[0], keys)
    logits = dst.run({2: ([ids[-1]], len(ids) - 1)})[2]
    torch.testing.assert_close(logits, full_logits(model, ids)[-1], atol=1e-4, rtol=0)
    src.cache.seq_load(1, 0, keys, values)  # into pools a forward allocated (inference tensors): a page-in
    torch.testing.assert_close(src.run({1: ([ids[-1]], len(ids) - 1)})[1], logits, atol=1e-5, rtol=0)


def test_load_is_refused_before_anything_changes():
    model = tiny_model("llama_gqa")
    src = _prefilled(model, list(range(5, 15)))
    keys, values = src.cache.seq_read(0, 0, 9)
    cache = CellCache(8, len(src.cache.layers), max_seqs=2)
    with pytest.raises(CacheFull):
        cache.seq_load(0, 0, keys, values)  # 9 cells into a pool of 8
    assert cache.used_cells() == 0
    cache.seq_load(0, 0, keys[:, :, :4], values[:, :, :4])
    with pytest.raises(CellCacheError, match="already holds"):
        cache.seq_load(0, 3, keys[:, :, :2], values[:, :, :2])
    with pytest.raises(CellCacheError, match="another model"):
        cache.seq_load(1, 0, keys[:, :1, :2], values[:, :1, :2])  # fewer heads than the pools
    with pytest.raises(CellCacheError, match="not all"):
        cache.seq_read(0, 0, 5)
    assert cache.used_cells() == 4 and cache.seq_positions(0).tolist() == [0, 1, 2, 3]
