"""Helpers for the engine tests: engines over tiny seeded models, independent oracles, output collectors.

Oracles never go through the engine or the cell cache: `greedy_oracle` is an argmax loop over
cacheless forwards of the whole history; `generate_oracle` is `transformers`' own `generate`.
"""

import asyncio

import torch
from tiny_models import full_logits, tiny_model, tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from engine.api.args import EngineArgs
from engine.api.outputs import RequestOutput
from engine.api.sampling_params import SamplingParams
from engine.core.engine import Engine
from engine.model.runner import ModelRunner

GREEDY = {"temperature": 0.0, "ignore_eos": True}
ASYNC_TIMEOUT_S = 60


def run_async(coro):
    """Run an AsyncEngine test's coroutine to completion, failing it after ASYNC_TIMEOUT_S rather than hanging."""
    return asyncio.run(asyncio.wait_for(coro, ASYNC_TIMEOUT_S))


def make_engine(model_name="llama_gqa", *, n_cells=256, attention="fast", max_seqs=256, tokenizer=None,
                model=None, **config) -> Engine:
    """An Engine over a tiny seeded model (or `model`); `config` goes to EngineArgs."""
    model = model if model is not None else tiny_model(model_name)
    runner = ModelRunner(model, tokenizer, n_cells=n_cells, attention=attention, max_seqs=max_seqs)
    return Engine(runner, EngineArgs(**config))


def prompt(n: int, seed: int, vocab: int = 100) -> list[int]:
    """n random token ids in [3, vocab) (clear of pad/bos/eos), reproducible from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def greedy_oracle(model, ids: list[int], k: int) -> list[int]:
    """k greedy tokens after `ids`, each the argmax of a cacheless forward over the whole history."""
    hist = list(ids)
    for _ in range(k):
        hist.append(int(full_logits(model, hist)[-1].argmax()))
    return hist[len(ids):]


def generate_oracle(model, ids: list[int], k: int) -> list[int]:
    """k greedy tokens after `ids` from `model.generate` (EOS cannot end it early)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=k, min_new_tokens=k, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **{**GREEDY, **kw})


class Collector:
    """An `emit` callback that keeps every RequestOutput delta and accumulates each choice."""

    def __init__(self):
        self.deltas: list[RequestOutput] = []
        self.tokens: dict[int, list[int]] = {}
        self.texts: dict[int, list[str]] = {}
        self.finish: dict[int, str | None] = {}
        self.stop_reason: dict[int, object] = {}
        self.errors: dict[int, str | None] = {}

    def __call__(self, out: RequestOutput) -> None:
        self.deltas.append(out)
        for c in out.outputs:
            self.tokens.setdefault(c.index, []).extend(c.token_ids)
            self.texts.setdefault(c.index, []).append(c.text)
            if c.finish_reason:
                assert c.index not in self.finish, f"choice {c.index} finished twice"
                self.finish[c.index] = c.finish_reason
                self.stop_reason[c.index] = c.stop_reason
                self.errors[c.index] = c.error

    @property
    def finished(self) -> bool:
        return bool(self.deltas) and self.deltas[-1].finished

    def text(self, index: int = 0) -> str:
        return "".join(self.texts.get(index, []))


def drain(engine: Engine, max_steps: int = 10_000) -> int:
    """Step until nothing is left to do; return the number of steps (fails rather than spin forever)."""
    for n in range(max_steps):
        if not engine.has_unfinished():
            return n
        engine.step()
    raise AssertionError(f"engine still busy after {max_steps} steps")


def check_cells_match_sequences(engine: Engine) -> None:
    """Scheduler invariant: every sequence holding a slot owns exactly the cells of positions [0, n_cached)."""
    for slot, seq in engine.scheduler.holders.items():
        assert seq.slot == slot
        held = engine.cache.seq_positions(slot).tolist()
        assert held == list(range(seq.n_cached)), (seq.seq_id, held, seq.n_cached)


def text_model(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    """A tiny seeded Llama whose vocabulary is the tiny tokenizer's (for tests that read text)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return model.eval()


def scripted_model(tokenizer, successor: dict[int, int], scale: float = 10.0) -> LlamaForCausalLM:
    """A real Llama whose weights make greedy decoding follow `successor` (token -> next token).

    Attention and MLP outputs are zeroed, so the last hidden state is the current token's embedding;
    each scripted token gets its own basis direction and the lm_head row of its successor points
    there. Used to stream an exact, chosen token sequence through the engine.
    """
    model = text_model(tokenizer)
    hidden = model.config.hidden_size
    assert len(successor) <= hidden, "one basis direction per scripted token"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for k, (tok, nxt) in enumerate(successor.items()):
            basis = torch.zeros(hidden)
            basis[k] = scale
            model.model.embed_tokens.weight[tok] = basis
            model.lm_head.weight[nxt] += basis
    return model


_TOKENIZER = None


def shared_tokenizer():
    """The tiny byte-level BPE tokenizer, trained once per test run."""
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = tiny_tokenizer()
    return _TOKENIZER


def run_requests(engine: Engine, prompts, params: SamplingParams, check=check_cells_match_sequences,
                 tag: str = "r") -> list["Collector"]:
    """One request per prompt (ids `{tag}{i}`), stepped until all finish, `check(engine)` after every tick
    (None: no check); the requests' collectors, in prompt order."""
    outs = []
    for i, p in enumerate(prompts):
        out = Collector()
        engine.add_request(f"{tag}{i}", p, params, out)
        outs.append(out)
    while engine.has_unfinished():
        engine.step()
        if check is not None:
            check(engine)
    return outs

