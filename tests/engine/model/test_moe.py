"""The native mixture-of-experts block (engine/model/native/moe.py) against transformers' own.

- the routed output of one block equals `Qwen3MoeSparseMoeBlock`'s (float32, atol 1e-5) for steps whose rows
  choose disjoint experts, overlapping experts, one row, and many random rows; each active expert runs once a
  step, and an expert no row chose is never read (its weights are NaN and the output stays exact);
- whole models (Qwen3-MoE with a dense layer among its MoE layers, Mixtral) over the cell pool: every row's
  logits equal a cacheless transformers forward of its history (fp32, atol 1e-4) through prefill, batched
  decode, forks and mixed prefill/decode steps, with the fused kernels and without;
- the engine's greedy output (prefill, decode, a fork of a running sequence) equals an argmax loop over
  transformers' forward.
"""

import pytest
import torch
from engine_support import Collector, drain, greedy, greedy_oracle, make_engine, prompt, run_requests
from tiny_models import full_logits
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from engine.model.kernels import build as kernels
from engine.model.native.moe import MoeBlock, route
from engine.model.runner import ModelRunner

E, K, HIDDEN = 8, 2, 32
VOCAB = 101


def _block(norm_topk_prob: bool, seed: int = 0) -> Qwen3MoeSparseMoeBlock:
    """A seeded block whose router scores expert e by 4 * h[e] (plus noise): a row's experts are chosen by
    which of its first E values are large."""
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=24, num_experts=E, num_experts_per_tok=K,
                         norm_topk_prob=norm_topk_prob)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        block.experts.gate_up_proj.normal_(0, 0.2)
        block.experts.down_proj.normal_(0, 0.2)
        block.gate.weight.copy_(4 * torch.eye(E, HIDDEN) + 0.01 * torch.randn(E, HIDDEN))
    return block


def _rows(choices: list[tuple[int, int]], seed: int = 1) -> torch.Tensor:
    """Hidden rows whose router picks `choices[i]` (first, second) for row i."""
    g = torch.Generator().manual_seed(seed)
    h = 0.1 * torch.randn(len(choices), HIDDEN, generator=g)
    for i, (a, b) in enumerate(choices):
        h[i, a] += 1.5
        h[i, b] += 1.0
    return h


CASES = {
    "disjoint": [(0, 1), (2, 3), (4, 5)],
    "overlapping": [(0, 1), (1, 2), (0, 1), (2, 7), (7, 0)],
    "one_row": [(3, 6)],
}


@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk", "raw_topk"])
@pytest.mark.parametrize("case", list(CASES))
def test_routed_output_matches_the_transformers_block_and_reads_only_chosen_experts(case, norm):
    block = _block(norm)
    h = _rows(CASES[case])
    with torch.no_grad():
        want = block(h[None])[0]
    ours = MoeBlock.of_module(block)
    r = route(ours.router(h), K, norm, h.dtype)
    chosen = sorted({e for pair in CASES[case] for e in pair})
    assert r.experts == chosen
    for e, a, b in zip(r.experts, r.bounds, r.bounds[1:]):  # each expert's rows, in row order
        assert r.rows[a:b].tolist() == [i for i, pair in enumerate(CASES[case]) if e in pair]
    calls = []
    swiglu = ours.experts.swiglu
    ours.experts.swiglu = lambda e, x: calls.append((e, x.shape[0])) or swiglu(e, x)
    with torch.no_grad():  # an expert no row chose: NaN weights, which would poison any row that read them
        for e in set(range(E)) - set(chosen):
            block.experts.gate_up_proj[e] = float("nan")
            block.experts.down_proj[e] = float("nan")
    got = ours(h)
    assert [e for e, _ in calls] == chosen, "each active expert once, no other"
    assert [n for _, n in calls] == [b - a for a, b in zip(r.bounds, r.bounds[1:])]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_many_random_rows_match_the_transformers_block():
    block = _block(True, seed=3)
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.5)  # router scores at random: rows spread over every expert
    h = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = block(h[None])[0]
    torch.testing.assert_close(MoeBlock.of_module(block)(h), want, atol=1e-5, rtol=0)


def _qwen3_moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    """Qwen3-MoE: q/k norms, 8 experts (top 2, renormalised), layer 1 a dense MLP (`mlp_only_layers`)."""
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                         num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, num_hidden_layers=3,
                         mlp_only_layers=[1], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=256)
    return Qwen3MoeForCausalLM(cfg)


def _mixtral(seed: int = 0) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_local_experts=6,
                        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256)
    return MixtralForCausalLM(cfg)


MODELS = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral}


def _model(name: str):
    model = MODELS[name]()
    with torch.no_grad():  # wider routers: steps whose rows spread over many experts
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.3)
    model.set_attn_implementation("sdpa")
    return model.eval()


class Harness:
    """A runner over one model; each step's rows checked against a cacheless forward of their histories."""

    def __init__(self, model, fused: bool):
        self.model = model
        self.runner = ModelRunner(model, n_cells=160)
        assert self.runner.native is not None and any(isinstance(layer.mlp, MoeBlock) for layer in self.runner.native.layers)
        self.runner.native.fused = fused and kernels.load()
        self.cache = self.runner.cache
        self.hist: dict[int, list[int]] = {}

    def step(self, chunks: dict[int, list[int]]) -> None:
        out = self.runner.run({s: (t, self.cache.next_pos(s)) for s, t in chunks.items()})
        for s, toks in chunks.items():
            self.hist.setdefault(s, []).extend(toks)
            torch.testing.assert_close(out[s], full_logits(self.model, self.hist[s])[-1], atol=1e-4, rtol=0)

    def next_token(self, s: int) -> int:
        return int(full_logits(self.model, self.hist[s])[-1].argmax())


@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "eager"])
@pytest.mark.parametrize("name", list(MODELS))
def test_whole_model_logits_match_transformers_over_the_cell_pool(name, fused):
    h = Harness(_model(name), fused)
    h.step({0: prompt(13, 1)})  # prefill
    for _ in range(3):
        h.step({0: [h.next_token(0)]})  # one-row decode: k experts a layer
    h.step({1: prompt(7, 2), 2: prompt(10, 3)})  # two prefills in one step
    for _ in range(2):
        h.step({s: [h.next_token(s)] for s in (0, 1, 2)})  # batched decode
    h.cache.seq_cp(1, 3)  # fork, then the branch and a partial fork's suffix prefill beside decodes
    h.hist[3] = list(h.hist[1])
    h.cache.seq_cp(2, 4, 5)
    h.hist[4] = h.hist[2][:5]
    h.step({3: [(h.next_token(1) + 1) % VOCAB], 1: [h.next_token(1)], 4: prompt(6, 4), 0: [h.next_token(0)]})


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_continuation_through_the_engine_matches_transformers(name):
    model = _model(name)
    engine = make_engine(model=model, n_cells=192)
    prompts = [prompt(9, 5), prompt(14, 6), prompt(4, 7)]
    outs = {}
    for i, p in enumerate(prompts):
        seq, _ = engine.create_sequence(p)
        outs[i] = seq.seq_id
    drain(engine)
    got = {}
    for i, sid in outs.items():
        got[i] = Collector()
        engine.add_request(f"r{i}", [], greedy(6), got[i], seq_id=sid)
    for _ in range(3):
        engine.step()
    assert len(got[0].tokens[0]) == 3
    child = engine.fork(outs[0]).seq_id  # a running sequence forked after 3 tokens
    branch = Collector()
    engine.add_request("b", [11], greedy(5), branch, seq_id=child)
    drain(engine)
    for i, p in enumerate(prompts):
        assert got[i].tokens[0] == greedy_oracle(model, p, 6)
    forked = prompts[0] + got[0].tokens[0][:3] + [11]
    assert branch.tokens[0] == greedy_oracle(model, forked, 5)


def test_a_saved_folder_loads_on_the_native_forward_with_one_copy_of_the_experts(tmp_path):
    """A Qwen3-MoE safetensors folder (`ModelRunner.from_pretrained`): the native forward runs it, the transformers
    modules' weights are released, and the experts the native block holds (views of the loaded stacks) still give
    transformers' logits."""
    model = _model("qwen3_moe")
    model.save_pretrained(tmp_path)
    runner = ModelRunner.from_pretrained(tmp_path, dtype="float32", n_cells=64)
    assert runner.native is not None
    blocks = [layer.mlp for layer in runner.native.layers if isinstance(layer.mlp, MoeBlock)]
    assert len(blocks) == 2  # layers 0 and 2; layer 1 is dense
    assert all(p.untyped_storage().nbytes() <= 4 for n, p in runner.model.named_parameters() if "experts" in n)
    ids = prompt(12, 8)
    out = runner.run({0: (ids, 0)})
    torch.testing.assert_close(out[0], full_logits(model, ids)[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_with_speculative_drafts_is_the_output_without_them(name):
    """Drafted rows verified in one step route and compute as the one-row decode does: the same tokens."""
    model = _model(name)
    repeating = prompt(7, 1) * 5  # a history whose continuation prompt lookup can guess
    prompts = [repeating, prompt(5, 3) * 4]
    want = [o.tokens[0] for o in run_requests(make_engine(model=model, speculative=None), prompts, greedy(16))]
    engine = make_engine(model=model, speculative="ngram")
    assert [o.tokens[0] for o in run_requests(engine, prompts, greedy(16))] == want
    assert want[0] == greedy_oracle(model, repeating, 16)
    assert engine.speculative.accepted > 0


def test_weight_bytes_count_the_experts_once():
    from engine.model.native.quant import weight_bytes

    model = _model("qwen3_moe")
    runner = ModelRunner(model, n_cells=32)
    n_params = sum(p.numel() for p in model.parameters())
    # every parameter once, in float32 (the router's packed copy replaces its weight; a tied table is not kept twice)
    assert weight_bytes(runner.native) == 4 * n_params


def test_quantize_at_load_refuses_a_moe_folder_with_the_reason(tmp_path):
    from engine.api.errors import ModelSourceError

    _model("qwen3_moe").save_pretrained(tmp_path)
    with pytest.raises(ModelSourceError, match="experts are not mapped for --quantize"):
        ModelRunner.from_pretrained(tmp_path, quantize="int8", n_cells=64)
