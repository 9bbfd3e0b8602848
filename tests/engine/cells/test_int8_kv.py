"""int8 KV cells (`kv_cache_dtype="int8"`, engine/cells/int8_kv.py and layer.py): the rounding rule, the packed
row form saved cells take, pools that hold what the sizing counts (~2x bf16's cells in one budget, ~4x
float32's), and seq_read / seq_load of int8 rows (bit for bit, refused across KV dtypes)."""

import struct

import pytest
import torch
from tiny_models import full_logits, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from engine.api.args import EngineArgs, kv_cache_dtype_for
from engine.cells import int8_kv
from engine.cells.cache import CellCacheError
from engine.model.runner import ModelRunner, kv_bytes_per_cell


def test_quantize_follows_the_absmax_rule_and_round_trips_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64) * torch.tensor([0.01, 1.0, 300.0])[:, None, None]  # heads of very different range
    x[2, 4] = 0  # a zero row: scale 0, reads back as zeros
    q, scale = int8_kv.quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (3, 5)
    amax = x.abs().amax(-1)
    torch.testing.assert_close(scale, amax / 127, rtol=0, atol=0)
    assert (q.abs().amax(-1)[amax > 0] == 127).all()  # each row's largest value uses the full range
    back = int8_kv.dequantize(q, scale, torch.float32)
    assert ((back - x).abs() <= scale[..., None] / 2 * (1 + 1e-6)).all()  # at most half a step off
    assert not back[2, 4].any() and scale[2, 4] == 0
    # round half to even, as torch.round: 0.5 and 1.5 steps of a row whose max is 127 steps
    row = torch.tensor([[127.0, 0.5, 1.5, -2.5]])
    assert int8_kv.quantize(row)[0].tolist() == [[127, 0, 2, -2]]


def test_pack_puts_the_scale_after_the_values_as_little_endian_float32():
    torch.manual_seed(1)
    q, scale = int8_kv.quantize(torch.randn(2, 3, 4, 16))
    packed = int8_kv.pack(q, scale)
    assert packed.shape == (2, 3, 4, 20) and packed.dtype == torch.int8
    assert bytes(packed[1, 2, 3, 16:].numpy().tobytes()) == struct.pack("<f", float(scale[1, 2, 3]))
    q2, s2 = int8_kv.unpack(packed)
    assert torch.equal(q2, q) and torch.equal(s2, scale)
    with pytest.raises(ValueError, match="head_dim \\+ 4"):
        int8_kv.unpack(torch.zeros(2, 4))  # float rows are not packed int8 rows


def _wide_llama(dtype):
    """A tiny Llama with SmolLM2's head size (64), so cell sizes are a real model's ratios."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def test_one_memory_budget_holds_about_twice_bf16s_cells_and_four_times_float32s():
    budget = 1 << 20
    cells = {}
    for dtype, kv in ((torch.bfloat16, "auto"), (torch.float32, "auto"), (torch.bfloat16, "int8")):
        runner = ModelRunner(_wide_llama(dtype), kv_memory_bytes=budget, kv_cache_dtype=kv)
        runner.run({0: (list(range(3, 12)), 0)})  # allocates the pools
        held = sum(t.nbytes for layer in runner.cache.layers
                   for t in (layer.keys, layer.values, layer.k_scale, layer.v_scale) if t is not None)
        assert held == runner.n_cells * runner.cell_bytes <= budget  # the sizing counts every byte, scales too
        cells[dtype, kv] = runner.n_cells
    assert kv_bytes_per_cell(_wide_llama(torch.float32).config, torch.float32, "int8") == 2 * 2 * 1 * (64 + 4)
    ratio_bf16 = cells[torch.bfloat16, "int8"] / cells[torch.bfloat16, "auto"]
    ratio_f32 = cells[torch.bfloat16, "int8"] / cells[torch.float32, "auto"]
    assert 1.85 < ratio_bf16 < 1.9 and 3.7 < ratio_f32 < 3.8  # 128/68 and 256/68: the scales cost 4 of 68 bytes


def test_a_bad_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8': use one of auto, model, int8"):
        EngineArgs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='int4': use one of auto, model, int8"):
        ModelRunner(tiny_model("llama_gqa"), n_cells=8, kv_cache_dtype="int4")


def test_auto_is_int8_cells_for_quantized_weights_and_the_models_dtype_otherwise():
    assert kv_cache_dtype_for("auto", quantized_weights=True) == "int8"
    assert kv_cache_dtype_for("auto", quantized_weights=False) == "model"
    for choice in ("model", "int8"):  # an explicit choice is kept either way
        assert kv_cache_dtype_for(choice, True) == kv_cache_dtype_for(choice, False) == choice
    for kv in ("auto", "model"):  # float weights: cells in the model's dtype
        runner = ModelRunner(_wide_llama(torch.bfloat16), n_cells=16, kv_cache_dtype=kv)
        runner.run({0: (list(range(3, 9)), 0)})
        assert runner.kv_cache_dtype == "model" and runner.cache.layers[0].keys.dtype == torch.bfloat16


def _prefilled(model, ids, kv="int8"):
    runner = ModelRunner(model, n_cells=64, max_seqs=4, kv_cache_dtype=kv)
    runner.run({0: (ids[:-1], 0)})
    return runner


def test_int8_rows_are_saved_packed_and_load_back_bit_for_bit():
    model = tiny_model("llama_gqa")
    ids = list(range(5, 25))
    src = _prefilled(model, ids)
    keys, values = src.cache.seq_read(0, 0, len(ids) - 1)
    head_dim = src.cache.layers[0].keys.shape[-1]
    assert keys.dtype == torch.int8 and keys.shape[-1] == head_dim + int8_kv.SCALE_BYTES
    want = src.run({0: ([ids[-1]], len(ids) - 1)})[0]

    dst = ModelRunner(model, n_cells=64, max_seqs=4, kv_cache_dtype="int8")  # fresh pools: seq_load allocates them
    dst.cache.seq_load(2, 0, keys[:, :, :7], values[:, :, :7])  # in two pieces, as chunks load
    dst.cache.seq_load(2, 7, keys[:, :, 7:], values[:, :, 7:])
    assert dst.cache.layers[0].keys.dtype == torch.int8 and dst.cache.layers[0].keys.shape[-1] == head_dim
    assert torch.equal(dst.cache.seq_read(2, 0, len(ids) - 1)[0], keys)
    got = dst.run({2: ([ids[-1]], len(ids) - 1)})[2]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)  # the same int8 rows: the same logits
    oracle = full_logits(model, ids)[-1]
    assert 0 < float((got - oracle).abs().max()) < 0.01 * float(oracle.abs().max())  # int8's error, and only that


def test_rows_of_another_kv_dtype_are_refused_before_anything_changes():
    model = tiny_model("llama_gqa")
    ids = list(range(5, 15))
    int8_rows = _prefilled(model, ids).cache.seq_read(0, 0, 9)
    float_rows = _prefilled(model, ids, "auto").cache.seq_read(0, 0, 9)
    for kv, rows in (("auto", int8_rows), ("int8", float_rows)):
        runner = ModelRunner(model, n_cells=64, max_seqs=4, kv_cache_dtype=kv)
        with pytest.raises(CellCacheError, match="another --kv-cache-dtype"):
            runner.cache.seq_load(0, 0, *rows)
        assert runner.cache.used_cells() == 0 and not runner.cache.layers[0].is_initialized
    pools = _prefilled(model, ids)
    with pytest.raises(CellCacheError, match="another model"):
        pools.cache.seq_load(1, 0, int8_rows[0][:, :, :, :-1], int8_rows[1][:, :, :, :-1])  # scale bytes cut
    assert pools.cache.used_cells() == 9
