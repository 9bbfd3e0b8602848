"""A mixture-of-experts GGUF file served from its own blocks: each expert a slice of the file's 3-D
`ffn_*_exps` tensors on the quantized kernels, the config built from the file's metadata (not through
transformers' conversion), against the same weights dequantized (`moe_gguf.write_moe_gguf`'s oracle: the
transformers model holding exactly what the file holds).

Bounds, and why:
- the eager path (no kernels: each expert's weight dequantized to fp32, then torch.mm): the oracle's own
  arithmetic up to float32 summation order: atol 1e-4 on the logits;
- with the kernels, a linear called with few rows rounds its activations to int8 per block as llama.cpp does
  (tests/engine/model/test_quant_linear.py: each output within sum |w| * da / 2): through these tiny models the
  logits moved by at most 0.007 (Q8_0, Q4_0) and 0.034 (Q4_K_M, hidden 256) when measured, asserted at 0.05
  (tests/engine/loader/test_gguf_quantized.py's bound), and the greedy tokens must be the oracle's. The router
  reads the same rounded hidden states (its logits moved by <= 0.15 of ~9 here); a near tie between two
  experts could flip a row's choice and break the bound: none did in these seeds.
"""

import gguf
import pytest
import torch
from engine_support import greedy, run_requests
from moe_gguf import VOCAB, q4_k_m, write_moe_gguf
from tiny_models import full_logits
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from engine.api.args import EngineArgs
from engine.api.errors import ModelSourceError
from engine.core.engine import Engine
from engine.loader.source import resolve_model
from engine.model.kernels import build as kernels
from engine.model.native.quant import QuantLinear, weight_bytes
from engine.model.runner import ModelRunner

Q = gguf.GGMLQuantizationType
DECODE_ATOL = 0.05


def _qwen3_moe(big: bool) -> Qwen3MoeForCausalLM:
    hidden, inter = (256, 256) if big else (64, 64)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * inter, moe_intermediate_size=inter,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return Qwen3MoeForCausalLM(cfg)


def _mixtral(big: bool) -> MixtralForCausalLM:
    hidden, inter = (256, 256) if big else (64, 64)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_local_experts=6,
                        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                        bos_token_id=1, eos_token_id=2)
    return MixtralForCausalLM(cfg)


CASES = {  # name: (model builder, big (K-quant shapes), linear types)
    "qwen3moe_q8_0": (_qwen3_moe, False, Q.Q8_0),
    "qwen3moe_q4_k_m": (_qwen3_moe, True, q4_k_m),
    "mixtral_q4_0": (_mixtral, False, Q.Q4_0),
    "mixtral_q4_k_m": (_mixtral, True, q4_k_m),
}


def _seeded(build, big: bool, seed: int):
    torch.manual_seed(seed)
    model = build(big).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norms away from 1 so a misplaced norm shows
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):  # routers that spread rows over the experts
                p.normal_(0, 0.2)
            elif "experts" in name:
                p.normal_(0, 0.02)
    model.set_attn_implementation("sdpa")
    return model


@pytest.fixture(scope="module", params=list(CASES))
def served(request, tmp_path_factory):
    build, big, qtype = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    oracle = write_moe_gguf(d / "tiny.gguf", _seeded(build, big, seed=3), qtype)
    folder = resolve_model(str(d / "tiny.gguf"), "auto", home=d / "home", progress=False).path
    return request.param, d / "tiny.gguf", folder, oracle


def _prompt(n, seed=0):
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_experts_stay_quantized_one_copy_each(served):
    name, _, folder, oracle = served
    runner = ModelRunner.from_pretrained(folder, n_cells=64)
    assert type(runner.model).__name__ == type(oracle).__name__
    cfg = runner.model.config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "num_experts_per_tok"):
        assert getattr(cfg, key) == getattr(oracle.config, key), key
    for layer in runner.native.layers:
        experts = layer.mlp.experts
        assert experts.count == (8 if name.startswith("qwen3moe") else 6)
        for lin in experts.linears():  # one quantized linear per expert and projection (gate|up as one)
            parts = getattr(lin, "parts", [lin])
            assert all(isinstance(p, QuantLinear) for p in parts)
    # the weights' bytes: about the file's quantized bytes (tile padding and K-quants' unpacked scales aside),
    # far below float32's
    n_params = sum(p.numel() for p in oracle.parameters())
    assert weight_bytes(runner.native) < 0.35 * 4 * n_params


@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "eager"])
def test_logits_match_the_dequantized_weights_and_greedy_tokens_agree(served, fused):
    _, _, folder, oracle = served
    runner = ModelRunner.from_pretrained(folder, n_cells=128, kv_cache_dtype="model")
    runner.native.fused = fused and kernels.load()
    atol = DECODE_ATOL if runner.native.fused else 1e-4
    hist = {0: _prompt(21, 1), 1: _prompt(6, 2)}
    out = runner.run({0: (hist[0], 0), 1: (hist[1], 0)})  # prefill: 27 rows over many experts
    worst = max(float((out[s] - full_logits(oracle, hist[s])[-1]).abs().max()) for s in (0, 1))
    for step in range(6):  # decode: one row (k experts a layer), then two rows
        seqs = (0,) if step < 3 else (0, 1)
        nxt = {s: int(out[s].argmax()) for s in seqs}
        out |= runner.run({s: ([nxt[s]], len(hist[s])) for s in seqs})
        for s in seqs:
            hist[s].append(nxt[s])
            want = full_logits(oracle, hist[s])[-1]
            assert int(want.argmax()) == int(out[s].argmax())  # greedy: the oracle's token
            worst = max(worst, float((out[s] - want).abs().max()))
    assert worst <= atol, worst


def test_metadata_the_loader_does_not_understand_is_a_clear_error(tmp_path):
    write_moe_gguf(tmp_path / "odd.gguf", _seeded(_qwen3_moe, False, seed=4), Q.Q8_0,
                   extra={"qwen3moe.expert_shared_feed_forward_length": 64})
    with pytest.raises(ModelSourceError, match="qwen3moe.expert_shared_feed_forward_length"):
        resolve_model(str(tmp_path / "odd.gguf"), "auto", home=tmp_path / "home", progress=False)
    write_moe_gguf(tmp_path / "yarn.gguf", _seeded(_qwen3_moe, False, seed=4), Q.Q8_0,
                   extra={"qwen3moe.rope.scaling.type": "yarn"})
    with pytest.raises(ModelSourceError, match="rope.scaling.type"):
        resolve_model(str(tmp_path / "yarn.gguf"), "auto", home=tmp_path / "home", progress=False)


def test_a_float_dtype_reads_the_experts_through_transformers_with_the_files_own_config(tmp_path):
    """`--dtype float32` on a qwen3moe file: transformers dequantizes it, given the config built here (its own
    mapping leaves moe_intermediate_size at the default and the load failed); the model holds the file's weights."""
    oracle = write_moe_gguf(tmp_path / "m.gguf", _seeded(_qwen3_moe, False, seed=5), Q.Q8_0)
    folder = resolve_model(str(tmp_path / "m.gguf"), "float32", home=tmp_path / "home", progress=False).path
    runner = ModelRunner.from_pretrained(folder, n_cells=64, dtype="float32")
    ids = _prompt(10, 3)
    out = runner.run({0: (ids, 0)})
    torch.testing.assert_close(out[0], full_logits(oracle, ids)[-1], atol=1e-4, rtol=0)


def test_quantized_greedy_with_speculative_drafts_is_the_output_without_them(tmp_path):
    """The experts' kernels compute each drafted row as the one-row decode does (tiles; the K-quants' row kernel in
    a step with drafts) and the router's logits row by row there: speculation changes no token."""
    write_moe_gguf(tmp_path / "s.gguf", _seeded(_qwen3_moe, True, seed=6), q4_k_m)
    folder = resolve_model(str(tmp_path / "s.gguf"), "auto", home=tmp_path / "home", progress=False).path
    repeating = _prompt(7, 1) * 5
    prompts = [repeating, _prompt(5, 3) * 4]
    outs = {}
    for spec in (None, "ngram"):
        engine = Engine(ModelRunner.from_pretrained(folder, n_cells=256), EngineArgs(speculative=spec))
        outs[spec] = [o.tokens[0] for o in run_requests(engine, prompts, greedy(16))]
    assert outs["ngram"] == outs[None]
    assert engine.speculative.accepted > 0
