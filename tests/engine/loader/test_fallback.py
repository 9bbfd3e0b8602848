"""Architectures without a native forward keep working through the transformers modules (the fallback): a GGUF
file's weights dequantized tensor by tensor to this CPU's float dtype (bfloat16 where it multiplies bf16 natively,
never float32 there), with a log line saying it is on the fallback and why; an architecture neither path takes is
a clear error naming it, at startup."""

import json
import logging

import gguf
import pytest
import torch
from tiny_gguf import tiny_gemma2, write_llama_gguf
from tiny_models import full_logits
from transformers import AutoModelForCausalLM

from engine.api.cpu import auto_float_dtype
from engine.api.errors import ModelSourceError
from engine.loader.source import resolve_model
from engine.model.runner import ModelRunner

Q = gguf.GGMLQuantizationType


def test_a_gguf_of_another_architecture_runs_on_the_fallback_in_the_cpus_float_dtype(tmp_path, caplog):
    path = write_llama_gguf(tmp_path / "g2.gguf", tiny_gemma2(seed=3), Q.Q8_0)
    caplog.set_level(logging.WARNING)
    folder = resolve_model(str(path), home=tmp_path / "home", progress=False).path  # dtype auto
    want = auto_float_dtype()
    info = json.loads((folder / "cellserve.json").read_text())
    assert info["architecture"] == "gemma2" and info["dtype"] == want
    assert "'gemma2' has no native forward" in caplog.text and "transformers fallback" in caplog.text
    caplog.clear()
    runner = ModelRunner.from_pretrained(folder, n_cells=64)
    assert runner.native is None and runner.dtype == getattr(torch, want)
    assert "Gemma2ForCausalLM runs on the transformers fallback" in caplog.text
    assert "not one of" in caplog.text  # the reason
    # the same weights, dequantized by transformers itself to the same dtype: the same logits within bf16 rounding
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="g2.gguf", dtype=getattr(torch, want)).eval()
    ids = list(range(5, 17))
    out = runner.run({0: (ids, 0)})[0]
    torch.testing.assert_close(out, full_logits(oracle, ids)[-1], atol=0.05 if want == "bfloat16" else 1e-4, rtol=0)
    text = "Nutritional facts"
    assert runner.tokenizer.decode(runner.tokenizer.encode(text, add_special_tokens=False)) == text


def test_quantized_on_another_architecture_is_the_fallback_too(tmp_path, caplog):
    path = write_llama_gguf(tmp_path / "g2.gguf", tiny_gemma2(), Q.Q8_0)
    caplog.set_level(logging.WARNING)
    folder = resolve_model(str(path), "quantized", home=tmp_path / "home", progress=False).path
    assert json.loads((folder / "cellserve.json").read_text())["dtype"] == auto_float_dtype()
    assert "transformers fallback" in caplog.text


def test_an_architecture_neither_path_takes_is_an_error_naming_it(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "fancyarch")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelSourceError, match="'fancyarch'"):
        resolve_model(str(tmp_path / "odd.gguf"), home=tmp_path / "home", progress=False)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "fancyarch", "architectures": ["FancyForCausalLM"]}))
    with pytest.raises(ModelSourceError, match="'FancyForCausalLM' has no native forward"):
        ModelRunner.from_pretrained(folder, n_cells=16)
