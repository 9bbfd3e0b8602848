"""The engine's memory account (engine/core/memory.py, engine/api/memory.py): each owner is what its holder
really holds, the step buffers' bound follows its formula, and the process readings are this process's."""

import torch

from engine.api.memory import MemoryReport, allocator_free, malloc_trim, process_rss
from engine.api.sampling_params import GuidedDecoding, SamplingParams
from engine.core.engine import Engine
from engine.core.memory import LOGIT_ROW_BYTES, step_buffer_bytes, weight_bytes
from engine.model.runner import ModelRunner


def _engine(model_dir, **kw) -> Engine:
    runner = ModelRunner.from_pretrained(model_dir, dtype=torch.float32, n_cells=kw.pop("n_cells", 1024))
    from engine.api.args import EngineArgs

    return Engine(runner, EngineArgs(**kw))


def test_owners_are_what_the_engine_holds(model_dir):
    engine = _engine(model_dir, max_num_batched_tokens=128)
    runner = engine.runner
    report = engine.memory()
    assert report.weights == weight_bytes(runner) > 0
    # every parameter of the tiny model is held by the native forward once (a tied head counted once)
    params = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in runner.model.parameters()}.values())
    assert 0.5 * params <= report.weights <= 1.5 * params
    assert report.cell_pool == runner.n_cells * runner.cell_bytes
    assert report.step_buffers == step_buffer_bytes(runner, 128)
    assert set(report.owners()) == {"weights", "cell_pool", "step_buffers", "grammar_cache", "prefix_index",
                                    "tokenizer", "lora_adapters", "allocator_free", "other"}
    rss, peak = process_rss()
    assert 0 < report.rss <= peak and abs(report.rss - rss) < 64 << 20
    assert report.other == max(0, report.rss - report.weights - report.cell_pool - sum(report.caches.values()))


def test_step_bound_follows_the_formula_and_grows_with_the_budget(model_dir):
    engine = _engine(model_dir)
    runner = engine.runner
    cfg = runner.config
    b, ctx = 64, min(runner.max_model_len, runner.n_cells)
    d = cfg.hidden_size // cfg.num_attention_heads
    expected = (b * (4 * cfg.hidden_size + (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
                     + 3 * cfg.intermediate_size) * 4
                + b * ctx * cfg.num_attention_heads * 4 + b * cfg.vocab_size * (4 + LOGIT_ROW_BYTES))
    assert step_buffer_bytes(runner, b) == expected
    assert step_buffer_bytes(runner, 2 * b) == 2 * expected


def test_caches_are_counted_as_they_fill(model_dir):
    engine = _engine(model_dir)
    before = engine.memory()
    assert before.caches["grammar_cache"] == 0 and before.caches["tokenizer"] > 0
    guided = GuidedDecoding(kind="json_schema", spec='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    engine.add_request("g", list(range(5, 40)), SamplingParams(max_tokens=4, guided=guided))
    engine.add_request("p", list(range(5, 140)), SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    after = engine.memory()
    assert after.caches["grammar_cache"] > 0  # xgrammar's cache, bounded by GRAMMAR_CACHE_BYTES
    assert after.caches["prefix_index"] > before.caches["prefix_index"]  # the finished prompts' blocks


def test_allocator_readings_and_trim_are_glibcs():
    free = allocator_free()
    assert free is None or free >= 0
    blocks = [bytearray(64 << 10) for _ in range(800)]  # ~50 MiB from the heap, then freed
    del blocks
    assert malloc_trim() in (True, False)
    assert isinstance(MemoryReport(1, 2, 3).lines(), str)
