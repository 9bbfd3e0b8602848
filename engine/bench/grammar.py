"""Grammar-mask cost: the measurement behind engine/sample/grammar.py's choice of xgrammar, reproducible.

    python -m engine.bench.grammar [--model FOLDER] [--rows 16]

1. Per-token mask cost of each installed candidate (xgrammar, llguidance, outlines-core; the last two
   are not dependencies: `pip install llguidance outlines-core` to compare) on the model's tokenizer: a
   5-field JSON schema walked token by token along a valid document (compile time, mean/p50/max per mask).
2. In the engine: the Sampler's mask time per step for `--rows` constrained rows against the forward of
   the same decode steps.
"""

import argparse
import json
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                 "zip": {"type": "string", "maxLength": 6}},
                "required": ["city", "zip"], "additionalProperties": False},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "tags", "address", "active"], "additionalProperties": False}
DOC = json.dumps({"name": "Romeo Montague", "age": 17, "tags": ["lover", "Verona", "tragic hero"],
                  "address": {"city": "Verona", "zip": "37100"}, "active": True})


def _walk(name: str, compile_matcher, fill, advance, ids: list[int]) -> None:
    """Time `compile_matcher()`, then `fill(matcher)` (one mask) before `advance(matcher, t)` at each token."""
    t0 = time.perf_counter()
    matcher = compile_matcher()
    compile_s, times = time.perf_counter() - t0, []
    for t in ids:
        t0 = time.perf_counter()
        fill(matcher)
        times.append(time.perf_counter() - t0)
        advance(matcher, t)
    times.sort()
    print(f"{name:14s} compile {compile_s * 1e3:7.1f} ms   mask mean {statistics.mean(times) * 1e6:7.1f} us   "
          f"p50 {times[len(times) // 2] * 1e6:6.1f} us   max {times[-1] * 1e6:8.1f} us")


def _accepted(ok: bool) -> None:
    assert ok, "the document's next token was refused"


def _xgrammar(tok, ids, V):
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V), max_threads=1)
    bitmask = xgr.allocate_token_bitmask(1, V)
    compile_schema = compiler.compile_json_schema
    _walk("xgrammar", lambda: xgr.GrammarMatcher(compile_schema(json.dumps(SCHEMA), any_whitespace=False)),
          lambda m: m.fill_next_token_bitmask(bitmask, 0), lambda m, t: _accepted(m.accept_token(t)), ids)


def _llguidance(tok, ids, V):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=V)
    bitmask = lt.allocate_token_bitmask(1, V)
    grammar = llguidance.LLMatcher.grammar_from_json_schema
    _walk("llguidance", lambda: llguidance.LLMatcher(lltok, grammar(json.dumps(SCHEMA))),
          lambda m: lt.fill_next_token_bitmask(m, bitmask, 0), lambda m, t: _accepted(m.consume_token(t)), ids)


def _outlines_core(tok, ids, V):
    import outlines_core as oc

    # byte-level BPE: map each token's printable form back to its bytes (GPT-2's table)
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    cs = bs + [256 + i for i in range(256 - len(bs))]
    bs += [b for b in range(256) if b not in bs]
    to_byte = {chr(c): b for b, c in zip(bs, cs)}
    vocab: dict[bytes, list[int]] = {}
    for i in range(len(tok)):
        s = tok.convert_ids_to_tokens(i)
        if i != tok.eos_token_id and s not in tok.all_special_tokens and all(ch in to_byte for ch in s):
            vocab.setdefault(bytes(to_byte[ch] for ch in s), []).append(i)
    def compile_guide():
        return oc.Guide(oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA)),
                                 oc.Vocabulary(tok.eos_token_id, vocab)))

    mask = torch.zeros((V + 31) // 32, dtype=torch.int32)
    _walk("outlines-core", compile_guide, lambda g: g.write_mask_into(mask.data_ptr(), mask.numel(), 4),
          lambda g, t: g.advance(t), ids)


def engine_share(model: str | None, rows: int) -> None:
    from engine.api.sampling_params import GuidedDecoding, SamplingParams
    from engine.core.llm import LLM
    from engine.sample import grammar

    llm = LLM(model) if model else LLM()
    masks, forwards = [], []
    apply, forward = grammar.apply_masks, llm.engine.runner.forward

    def timed_apply(x, r, states):
        t0 = time.perf_counter()
        apply(x, r, states)
        masks.append(time.perf_counter() - t0)

    def timed_forward(step):
        t0 = time.perf_counter()
        out = forward(step)
        forwards.append((time.perf_counter() - t0, len(step.tokens)))
        return out

    grammar.apply_masks, llm.engine.runner.forward = timed_apply, timed_forward
    guided = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    llm.generate(["ROMEO:"] * rows, [SamplingParams(max_tokens=100, temperature=1.0, seed=i, guided=guided)
                                     for i in range(rows)], use_tqdm=False)
    decode = statistics.median(t for t, n in forwards if n <= rows)
    mask = statistics.median(masks)
    print(f"engine, {rows} constrained rows, {len(masks)} steps: mask median {mask * 1e3:.3f} ms, decode forward "
          f"median {decode * 1e3:.2f} ms -> {mask / decode * 100:.1f}% of a step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Hugging Face folder (default: the bundled model)")
    ap.add_argument("--rows", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from engine.loader.default import DEFAULT_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(args.model or DEFAULT_MODEL_DIR)
    V, ids = len(tok), tok.encode(DOC, add_special_tokens=False)
    print(f"vocabulary {V}, document {len(ids)} tokens")
    for run in (_xgrammar, _llguidance, _outlines_core):
        try:
            run(tok, ids, V)
        except ImportError as exc:
            print(f"{run.__name__[1:]:14s} not installed ({exc.name})")
    engine_share(args.model, args.rows)


if __name__ == "__main__":
    main()
