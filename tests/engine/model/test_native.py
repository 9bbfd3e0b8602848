"""The native Llama-family forward (engine/model/native/model.py) against the transformers oracle.

The equivalence matrix in test_runner_equivalence.py runs it on every supported architecture; these
tests pin what that matrix does not reach: each of its three attention modes, steps mixing them,
bf16 against the fp32 oracle, and which models it refuses.
"""

import pytest
import torch
from tiny_models import full_logits, tiny_model

from engine.model.kernels import build as kernels
from engine.model.native import model as native_mod
from engine.model.native.attention import Attend
from engine.model.native.linear import Linear
from engine.model.runner import ModelRunner

ATOL = 1e-4


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 100, (n,), generator=g).tolist()


def _modes(monkeypatch) -> list[str]:
    """Record the attention mode of every native step."""
    seen = []
    orig = Attend.__init__

    def spy(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        seen.append(self.mode)

    monkeypatch.setattr(Attend, "__init__", spy)
    return seen


@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "eager"])
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2", "qwen2_sliding", "mistral", "qwen3", "gemma3"])
def test_every_attention_mode_matches_the_oracle(name, fused, monkeypatch):
    model = tiny_model(name)
    runner = ModelRunner(model, n_cells=512)
    assert runner.native is not None
    assert runner.native.fused, f"the fused kernels did not load: {kernels.why_not()}"
    runner.native.fused = fused
    modes = _modes(monkeypatch)
    hist = {0: _prompt(150, 1), 1: _prompt(9, 2)}
    out = runner.run({0: (hist[0], 0), 1: (hist[1], 0)})  # 159 tokens: each long chunk goes to sdpa over its own cells
    for s in range(2, 10):
        hist[s] = _prompt(4 + s, 10 + s)
        out |= runner.run({s: (hist[s], 0)})  # short prefills: one sdpa part holding every row
    short = list(range(1, 10))
    for _ in range(3):  # 9 decodes, each row sees few of the window's cells: per-row gather
        nxt = {s: int(out[s].argmax()) for s in short}
        out |= runner.run({s: ([nxt[s]], len(hist[s])) for s in short})
        for s in short:
            hist[s].append(nxt[s])
        torch.testing.assert_close(out[5], full_logits(model, hist[5])[-1], atol=ATOL, rtol=0)
    # a step mixing a decode with a suffix prefill of another sequence
    fed = int(out[0].argmax())
    hist[1] += _prompt(5, 99)
    out = runner.run({0: ([fed], len(hist[0])), 1: (hist[1][-5:], len(hist[1]) - 5)})
    hist[0].append(fed)
    for s in (0, 1):
        torch.testing.assert_close(out[s], full_logits(model, hist[s])[-1], atol=ATOL, rtol=0)
    # a long prefill beside decodes: the chunk reads only its own cells (sdpa), the decodes are gathered
    hist[10] = _prompt(140, 7)
    nxt = {s: int(out[s].argmax()) for s in (0, 1)}
    out = runner.run({0: ([nxt[0]], len(hist[0])), 10: (hist[10], 0), 1: ([nxt[1]], len(hist[1]))})
    for s in (0, 1):
        hist[s].append(nxt[s])
    for s in (0, 1, 10):
        torch.testing.assert_close(out[s], full_logits(model, hist[s])[-1], atol=ATOL, rtol=0)
    hist[10].append(int(out[10].argmax()))  # one sequence decoding alone reads its window densely
    out = runner.run({10: (hist[10][-1:], len(hist[10]) - 1)})
    torch.testing.assert_close(out[10], full_logits(model, hist[10])[-1], atol=ATOL, rtol=0)
    # a step whose one part holds every row runs as that part (eager: a lone short prefill is "sdpa"; the
    # kernel's "cells" part also holds short prefills and drafts)
    assert set(modes) == ({"split", "cells"} if fused else {"split", "dense", "gather", "sdpa"})


@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "eager"])
def test_bf16_stays_close_to_the_fp32_oracle(fused):
    """bf16 rounds differently from fp32 at every op: same top token, logits within a stated 0.05."""
    model = tiny_model("llama_gqa")
    ref_model = tiny_model("llama_gqa")
    runner = ModelRunner(model.to(torch.bfloat16), n_cells=256)
    assert runner.native is not None
    runner.native.fused = fused
    hist = {s: _prompt(6 + s, s) for s in range(4)}
    out = runner.run({s: (h, 0) for s, h in hist.items()})
    for _ in range(4):
        nxt = {s: int(full_logits(ref_model, h)[-1].argmax()) for s, h in hist.items()}
        out = runner.run({s: ([nxt[s]], len(hist[s])) for s in hist})
        for s, h in hist.items():
            h.append(nxt[s])
    for s, h in hist.items():
        ref = full_logits(ref_model, h)[-1]
        torch.testing.assert_close(out[s], ref, atol=0.05, rtol=0)


def test_unsupported_models_use_the_transformers_modules():
    assert native_mod.native_unsupported(tiny_model("gpt2")) is not None
    runner = ModelRunner(tiny_model("gpt2"), n_cells=64)
    assert runner.native is None
    with pytest.raises(ValueError, match="native=True"):
        ModelRunner(tiny_model("gpt2"), n_cells=64, native=True)
    assert ModelRunner(tiny_model("llama_gqa"), n_cells=64, attention="reference").native is None


def test_linear_fallback_matches_packed():
    """Without oneDNN packing (other dtypes, other CPUs) the eager epilogues give the same results."""
    torch.manual_seed(0)
    w, b = torch.randn(24, 16), torch.randn(24)
    x, other = torch.randn(3, 16), torch.randn(3, 24)
    packed = Linear([w], b)
    plain = Linear([w], b)
    plain.packed, plain.weight = None, w
    for fn in ("__call__", "silu"):
        torch.testing.assert_close(getattr(packed, fn)(x), getattr(plain, fn)(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed.times(x, other), plain.times(x, other), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed.plus(x, other), plain.plus(x, other), atol=1e-5, rtol=1e-5)


def test_linear_small_rows_match_packed():
    """With the small-row kernel on, one-row calls (and only those) take it, with the same results;
    the Q|K|V linear keeps one copy of its three weights: the packed one, which one-row calls read too."""
    assert kernels.load(), kernels.why_not()
    torch.manual_seed(0)
    parts, b = [torch.randn(24, 40), torch.randn(8, 40), torch.randn(8, 40)], torch.randn(40)
    ref = Linear(parts, b)
    small = Linear(parts, b)
    small.small = True
    assert small.panels is not None and small.parts is None and small.weight is None, "one copy: the packed one"
    one, three = torch.randn(1, 40), torch.randn(3, 40)
    assert small.is_small(one) and not small.is_small(three)
    torch.testing.assert_close(small(one), ref(one), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(small(three), ref(three), atol=1e-5, rtol=1e-5)
    other = torch.randn(1, 40)
    torch.testing.assert_close(small.plus(one, other), ref.plus(one, other), atol=1e-5, rtol=1e-5)


def test_a_local_layer_reads_only_its_windows_cells(monkeypatch):
    """Gemma 3's local layers (window 4) read only the cells inside their window, the global layer every visible
    cell, in one step (the kernel's `cells` part, one list per window), and the logits stay the oracle's."""
    model = tiny_model("gemma3")
    runner = ModelRunner(model, n_cells=256)
    assert runner.native.fused, kernels.why_not()
    parts = []
    orig = Attend.__init__

    def spy(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        parts.append(self.parts)

    monkeypatch.setattr(Attend, "__init__", spy)
    hist = {0: _prompt(30, 1), 1: _prompt(12, 2)}
    out = runner.run({s: (h, 0) for s, h in hist.items()})
    nxt = {s: int(out[s].argmax()) for s in hist}
    out = runner.run({s: ([nxt[s]], len(h)) for s, h in hist.items()})
    cells = parts[-1][0].cells
    assert set(cells) == {4, None} and cells[4].shape[1] == 4 and cells[None].shape[1] == 31
    for s, h in hist.items():
        torch.testing.assert_close(out[s], full_logits(model, [*h, nxt[s]])[-1], atol=ATOL, rtol=0)
