"""LoRA adapters on the native forward (engine/model/lora.py) against PEFT's merged model (float32).

Each adapter is a random PEFT LoRA saved as a folder and read back by engine/loader/adapters.py; the oracle is
PEFT's own model with the adapter merged into its weights, run cacheless by transformers. Tolerance: the
suite's float32 atol 1e-4 (the update is computed unmerged, so only the summation order differs).
"""

import copy
import json

import pytest
import torch
from lora_support import ALL, ATTN, peft_adapter
from peft import PeftModel
from safetensors.torch import save_file
from tiny_models import full_logits, tiny_model, tiny_tokenizer

from engine.api.lora import AdapterMemoryFull, AdapterNotFound, LoraBinding
from engine.loader.adapters import AdapterError
from engine.loader.quantize import quantize_weight
from engine.model.flat_step import flatten_step
from engine.model.lora import step_rows
from engine.model.runner import ModelRunner

ATOL = 1e-4


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 100, (n,), generator=g).tolist()


def _step(runner, chunks: dict, bindings: list):
    """Run `{slot: (ids, start)}` with each chunk under its binding; logits of each chunk's last row."""
    step = flatten_step(chunks)
    step.lora = step_rows(bindings, [len(ids) for ids, _ in chunks.values()])
    return dict(zip(chunks, runner.forward(step)))


@pytest.mark.parametrize("fused,stacking,kernel", [(True, True, True), (True, True, False), (False, True, True),
                                                  (True, False, True)],
                         ids=["kernels", "stacked-onednn", "eager", "one-pass-per-adapter"])
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2"])
def test_base_and_two_adapters_in_one_step_match_peft(name, fused, stacking, kernel, tmp_path):
    """r 8 on q,k,v,o and the MLP, r 16 (rsLoRA) on attention only: one step holds base rows and both
    adapters' rows (prefills, then decodes), each row's logits its own model's."""
    base = tiny_model(name)
    p8, m8 = peft_adapter(base, tmp_path / "r8", r=8, targets=ALL, seed=1)
    p16, m16 = peft_adapter(base, tmp_path / "r16", r=16, alpha=8, targets=ATTN, seed=2, rslora=True)
    runner = ModelRunner(tiny_model(name), n_cells=512)
    runner.native.fused = fused
    runner.loras.stacking, runner.loras.kernel = stacking, kernel  # kernel: lora_update for few-row steps
    a8, _ = runner.loras.load("r8", p8)
    a16, _ = runner.loras.load("r16", p16)
    b8, b16 = LoraBinding(a8.uid, "r8"), LoraBinding(a16.uid, "r16")
    models = {0: base, 1: m8, 2: m16, 3: m8, 4: base}
    binds = [None, b8, b16, b8, None]
    hist = {s: _ids(5 + 3 * s, s) for s in models}
    out = _step(runner, {s: (hist[s], 0) for s in models}, binds)
    for _ in range(3):
        for s, model in models.items():
            torch.testing.assert_close(out[s], full_logits(model, hist[s])[-1], atol=ATOL, rtol=0)
        nxt = {s: int(out[s].argmax()) for s in models}
        out = _step(runner, {s: ([nxt[s]], len(hist[s])) for s in models}, binds)
        for s in models:
            hist[s].append(nxt[s])


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2", "qwen3"])
def test_rank_64_adapters_beside_the_base_match_peft(name, tmp_path):
    """r 64 (past the tiny models' hidden size: the update is still exact) on q,k,v,o and the MLP, and r 64 on
    attention only (rsLoRA), in one step with a base row: prefill, then one decode step."""
    base = tiny_model(name)
    p1, m1 = peft_adapter(base, tmp_path / "all", r=64, alpha=32, targets=ALL, seed=5)
    p2, m2 = peft_adapter(base, tmp_path / "attn", r=64, alpha=8, targets=ATTN, seed=6, rslora=True)
    runner = ModelRunner(tiny_model(name), n_cells=256)
    a1, _ = runner.loras.load("all", p1)
    a2, _ = runner.loras.load("attn", p2)
    assert a1.info.rank == a2.info.rank == 64
    models, binds = {0: m1, 1: base, 2: m2}, [LoraBinding(a1.uid, "all"), None, LoraBinding(a2.uid, "attn")]
    hist = {s: _ids(7 + 2 * s, 10 + s) for s in models}
    out = _step(runner, {s: (hist[s], 0) for s in models}, binds)
    for s in models:
        hist[s].append(int(out[s].argmax()))
    out = _step(runner, {s: ([hist[s][-1]], len(hist[s]) - 1) for s in models}, binds)
    for s, model in models.items():
        torch.testing.assert_close(out[s], full_logits(model, hist[s])[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("module", ["mlp.experts.3.gate_proj", "mlp.gate", "block_sparse_moe.experts.0.w1"])
def test_an_adapter_of_expert_mlps_is_refused_naming_the_module(module, tmp_path):
    """A mixture-of-experts adapter (an expert's MLP, the router) is refused at load with the module's name;
    nothing is loaded."""
    key = f"base_model.model.model.layers.1.{module}"
    save_file({f"{key}.lora_A.weight": torch.zeros(4, 32), f"{key}.lora_B.weight": torch.zeros(32, 4)},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    runner = ModelRunner(tiny_model("llama_gqa"), n_cells=16)
    with pytest.raises(AdapterError, match=f"targets layers.1.{module}, a mixture-of-experts expert MLP or router"):
        runner.loras.load("moe", str(tmp_path))
    assert not runner.loras.adapters


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_qwen3_and_gemma3_adapter_rows_match_peft(name, tmp_path):
    """The update lands before Qwen3's / Gemma 3's q/k norms, before Gemma's GeGLU and its post-attention and
    post-MLP norms: the same as PEFT's."""
    base = tiny_model(name)
    path, merged = peft_adapter(base, tmp_path / "a", r=8, targets=ALL)
    runner = ModelRunner(tiny_model(name), n_cells=256)
    a, _ = runner.loras.load("a", path)
    ids = _ids(11, 6)
    out = _step(runner, {0: (ids, 0), 1: (ids, 0)}, [LoraBinding(a.uid, "a"), None])
    torch.testing.assert_close(out[0], full_logits(merged, ids)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], full_logits(base, ids)[-1], atol=ATOL, rtol=0)


def test_an_adapter_changes_its_rows_only_and_a_scale_scales_it(tmp_path):
    """A base-only step runs no hook; an adapter's rows differ from the base's; llama.cpp's scale 0 is the
    base and scale 2 is the PEFT model of twice the alpha."""
    base = tiny_model("llama_gqa")
    path, _ = peft_adapter(base, tmp_path / "a", r=8, alpha=16)
    _, doubled = peft_adapter(base, tmp_path / "b", r=8, alpha=32)  # same seed: the same A and B
    runner = ModelRunner(tiny_model("llama_gqa"), n_cells=256)
    a, _ = runner.loras.load("a", path)
    ids = _ids(9, 3)
    out = _step(runner, {0: (ids, 0), 1: (ids, 0), 2: (ids, 0)},
                [LoraBinding(a.uid, "a", 0.0), LoraBinding(a.uid, "a", 2.0), None])
    torch.testing.assert_close(out[0], full_logits(base, ids)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], full_logits(doubled, ids)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[2], full_logits(base, ids)[-1], atol=ATOL, rtol=0)


def test_quantized_base_weights_with_an_adapter_match_the_dequantized_oracle(tmp_path):
    """int8 base weights (--quantize int8), run without the kernels' activation rounding: the oracle is
    the same quantized weights dequantized into transformers, with the PEFT adapter merged on top."""
    base = tiny_model("llama_gqa")
    base.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    path, _ = peft_adapter(base, tmp_path / "a", r=16, targets=ALL)
    runner = ModelRunner.from_pretrained(tmp_path / "model", quantize="int8", n_cells=64, kv_cache_dtype="model")
    runner.native.fused = False
    deq = copy.deepcopy(base)
    with torch.no_grad():
        for name, m in deq.named_modules():
            if name.endswith("_proj") or name == "lm_head":
                m.weight.copy_(quantize_weight(m.weight, "q8_0").dequantize())
    oracle = PeftModel.from_pretrained(copy.deepcopy(deq), path).merge_and_unload().eval()
    a, _ = runner.loras.load("a", path)
    ids = _ids(13, 4)
    out = _step(runner, {0: (ids, 0), 1: (ids, 0)}, [LoraBinding(a.uid, "a"), None])
    torch.testing.assert_close(out[0], full_logits(oracle, ids)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], full_logits(deq, ids)[-1], atol=ATOL, rtol=0)


def test_registry_limits_least_recently_used_and_clear_refusals(tmp_path):
    base = tiny_model("llama_gqa")
    paths = [peft_adapter(base, tmp_path / f"a{i}", r=8, seed=i)[0] for i in range(3)]
    runner = ModelRunner(tiny_model("llama_gqa"), n_cells=64)
    reg = runner.loras
    reg.max_loras = 2
    a0, _ = reg.load("a0", paths[0])
    reg.load("a1", paths[1])
    reg.get("a0")  # a1 is now the least recently used
    _, gone = reg.load("a2", paths[2])
    assert [g.name for g in gone] == ["a1"] and list(reg.adapters) == ["a0", "a2"]
    with pytest.raises(AdapterMemoryFull, match="all in use"):  # both resident ones run requests
        reg.load("a1", paths[1], busy=frozenset(a.uid for a in reg.adapters.values()))
    assert list(reg.adapters) == ["a0", "a2"]  # nothing changed
    reg.max_bytes = a0.nbytes - 1
    with pytest.raises(AdapterMemoryFull, match="max_lora_memory"):
        reg.load("big", paths[1])
    with pytest.raises(AdapterNotFound, match="a0, a2"):
        reg.unload("nope")
    with pytest.raises(AdapterError, match="not a PEFT LoRA folder"):
        reg.load("x", str(tmp_path))
    other = tiny_model("qwen2")  # another base: the shapes disagree
    with pytest.raises(AdapterError, match="another base model"):
        reg.max_bytes = None
        reg.load("q", peft_adapter(other, tmp_path / "q", r=8)[0])
    assert list(reg.adapters) == ["a0", "a2"]
