"""A model over int8 KV cells (`kv_cache_dtype="int8"`) against the cacheless fp32 oracle, on all three
paths that read cells: the native forward with the fused kernels (int8 rows read in place), the native
forward's eager ops (only the rows a step reads dequantized) and the transformers modules (the step's
read window dequantized).

The tolerance: int8 cells change every K and V value by at most half a quantization step, 1/254 of its
head row's largest magnitude (int8_kv's absmax rule), so each attention score and output moves by
about 0.2-0.4% of its scale; through two layers the logits of these tiny models move by ~0.1-0.2% of
their largest magnitude (measured: 0.08% on llama_gqa, 0.2% on qwen2_sliding). The bound is 1% of the
oracle's largest logit, 5x that, and the float cells' own error (1e-7 here) shows the difference is the
int8 rounding's: it must be above 1e-6 (so the int8 path did run) and far below the bound.
"""

import pytest
import torch
from tiny_models import full_logits, tiny_model

from engine.api.sampling_params import SamplingParams
from engine.core.llm import LLM
from engine.model.kernels import build as kernels
from engine.model.native.attention import Attend
from engine.model.runner import ModelRunner

BOUND = 0.01  # of the oracle's largest |logit| (see the module docstring)
# The tiny Gemma 3's logits are small (|logit| <= ~0.3: a soft-capped, tied 0.02-std head) while its q/k norms
# hold every K row near unit RMS: the same int8 rounding moves them by ~1.3% of their largest, measured alike on
# all three paths (the transformers modules' too), so the rounding's, not a path's. Its bound: 3%.
BOUNDS = {"gemma3": 0.03}


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 100, (n,), generator=g).tolist()


def _runner(model, path: str) -> ModelRunner:
    runner = ModelRunner(model, n_cells=512, kv_cache_dtype="int8", native=None if path != "hf" else False)
    assert runner.cache.kv_dtype == torch.int8
    if path != "hf":
        assert runner.native is not None and runner.native.fused, f"kernels did not load: {kernels.why_not()}"
        runner.native.fused = path == "kernels"
    return runner


@pytest.mark.parametrize("path", ["kernels", "eager", "hf"])
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_sliding", "qwen3", "gemma3"])
def test_int8_cells_give_the_oracles_logits_within_the_stated_bound(name, path, monkeypatch):
    model = tiny_model(name)
    runner = _runner(model, path)
    bound = BOUNDS.get(name, BOUND)
    modes, init = [], Attend.__init__

    def spy(self, *args, **kwargs):  # records each step's attention mode
        init(self, *args, **kwargs)
        modes.append(self.mode)

    monkeypatch.setattr(Attend, "__init__", spy)
    hist = {s: _prompt(20 + 37 * s, s) for s in range(4)}  # prefill chunks (sdpa parts over int8 rows)
    out = runner.run({s: (hist[s], 0) for s in hist})
    worst = 0.0
    for step in range(6):  # decodes: per-row cells (kernel) / gather (eager), one mixing a new prefill
        nxt = {s: int(out[s].argmax()) for s in hist}
        chunks = {s: ([nxt[s]], len(hist[s])) for s in hist}
        if step == 3:
            hist[9] = _prompt(30, 9)
            chunks[9] = (hist[9], 0)
        out = runner.run(chunks)
        for s, token in nxt.items():
            hist[s].append(token)
        for s in chunks:
            oracle = full_logits(model, hist[s])[-1]
            err = float((out[s] - oracle).abs().max())
            assert err < bound * float(oracle.abs().max()), (s, step, err)
            worst = max(worst, err)
    hist[0].append(int(out[0].argmax()))  # one sequence decoding alone: the eager path reads its window densely
    oracle = full_logits(model, hist[0])[-1]
    err = float((runner.run({0: (hist[0][-1:], len(hist[0]) - 1)})[0] - oracle).abs().max())
    assert err < bound * float(oracle.abs().max())
    assert max(worst, err) > 1e-6  # the int8 rounding is there: float cells agree to ~1e-7
    if path != "hf":
        assert set(modes) == ({"split", "cells"} if path == "kernels" else {"split", "gather", "dense"})


def test_kernel_and_eager_paths_agree_over_int8_cells():
    """Both native paths store the same int8 rows (V bit for bit, K within one step where the fused RoPE
    rounds once) and read them the same way: far closer to each other than either is to the oracle."""
    model = tiny_model("llama_gqa")
    runs = {}
    for path in ("kernels", "eager"):
        runner, hist = _runner(model, path), {s: _prompt(40 + s, s) for s in range(3)}
        out = runner.run({s: (hist[s], 0) for s in hist})
        out = runner.run({s: ([int(out[s].argmax())], len(hist[s])) for s in hist})
        runs[path] = torch.stack([out[s] for s in hist])
    torch.testing.assert_close(runs["kernels"], runs["eager"], atol=5e-5, rtol=0)


def test_bf16_model_over_int8_cells_stays_within_bf16s_own_bound():
    """bf16 weights and activations already move logits by ~1% on these models (test_native's bf16 bound);
    int8 cells must not make that worse beyond their own share."""
    model = tiny_model("llama_gqa")
    prompts = {s: _prompt(30 + s, s) for s in range(3)}
    bf16 = tiny_model("llama_gqa").to(torch.bfloat16)
    for kv in ("auto", "int8"):
        runner = ModelRunner(bf16, n_cells=256, kv_cache_dtype=kv)
        out = runner.run({s: (p, 0) for s, p in prompts.items()})
        for s, p in prompts.items():
            oracle = full_logits(model, p)[-1]
            assert float((out[s] - oracle).abs().max()) < 0.05 * float(oracle.abs().max()), (kv, s)


def test_greedy_generation_over_int8_cells_is_the_float_cells_on_the_bundled_model():
    """The bundled model has learned something, so its greedy choices have real margins (a tiny random
    model's top logits lie within int8's rounding of each other; there a near tie may flip, and that is
    no error). Measured: 6 of 6 prompts identical over 32 tokens; held to all of them over 24."""
    prompts = ["ROMEO:", "JULIET:\nO", "First Citizen:\nWe are", "KING HENRY:", "To be, or not", "MERCUTIO:\nNay,"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = LLM(None, dtype="float32", n_cells=512).generate(prompts, params, use_tqdm=False)  # as measured
    llm = LLM(None, dtype="float32", n_cells=512, kv_cache_dtype="int8")
    assert llm.engine.runner.cache.kv_dtype == torch.int8
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert llm.engine.cache.used_cells() <= sum(len(g.prompt_token_ids) + 24 for g in got)  # cached prefixes only
