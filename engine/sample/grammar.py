"""Structured output: grammars compiled with xgrammar, one matcher per generating row, masks in the Sampler.

Why xgrammar (`python -m engine.bench.grammar`, which reproduces these): on this CPU, with the bundled
model's tokenizer (4096 tokens) and a 5-field JSON schema walked token by token (87 tokens), the
per-token mask cost was xgrammar 3-5 us mean / 66-165 us worst, llguidance 50-100 us mean / 1.7-6.5 ms
worst (its first mask), outlines-core 3-5 us mean but an 11-38 ms compile that grows with vocabulary x
automaton states (196 ms with SmolLM2's 49k tokens) and no context-free grammars. xgrammar also
compiles EBNF (vLLM's `guided_grammar`), regexes and structural tags (tool calls) with precise errors.
In the engine, masks for 16 constrained rows cost 6.9% of a decode step of the (tiny) bundled model,
64 rows 9.1%, and 0.4% of a SmolLM2-135M step.

Guarantees:
- `GrammarCompiler.compile` either returns a compiled grammar or raises `InvalidRequest` naming the
  request field the grammar came from (`response_format`, `guided_json`, `tool_choice`, ...) and
  what the engine could not compile, so the HTTP layer answers 400 before anything runs.
- A `GrammarState` follows exactly the tokens its row generated; the row's allowed set at every step
  is the grammar's, and EOS is allowed only when the grammar is complete (xgrammar's stop tokens are
  the engine's EOS ids). `terminated` is true once the grammar has accepted EOS: the choice ends
  with finish_reason "stop".
- `apply_masks` fills one bitmask row per constrained row (one C++ call each: a loop over rows, never
  over tokens or the vocabulary) and applies them in one vectorised op, so constrained and free rows
  share a batch and free rows are untouched.
"""

from __future__ import annotations

import json

import torch

from engine.api.errors import InvalidRequest
from engine.api.sampling_params import GuidedDecoding

# JSON is produced compactly (`, ` and `: ` separators, no free whitespace): a model cannot loop on
# whitespace inside a structure, and any JSON parser reads it (vLLM's `disable_any_whitespace`).
_ANY_WHITESPACE = False

# A small model given a free number or free whitespace can write `1111...` or newlines until max_tokens.
# llama.cpp's JSON-schema grammar bounds them; so do we, by rewriting xgrammar's JSON rules: at most 16
# integer digits, 16 fraction digits and 3 exponent digits, and whitespace (where a grammar allows it:
# JSON inside tool-call tags) of one space (one free character) or of one space or one newline plus up to
# 20 indent characters (a free run).
_BOUNDED_RULES = {
    'basic_integer ::= (("0") | (basic_integer_1 [1-9] [0-9]*))':
        'basic_integer ::= (("0") | (basic_integer_1 [1-9] [0-9]{0, 15}))',
    'basic_number_2 ::= (("0") | ([1-9] [0-9]*))': 'basic_number_2 ::= (("0") | ([1-9] [0-9]{0, 15}))',
    'basic_number_3 ::= ("" | ("." basic_number_digits{1, -1}))':
        'basic_number_3 ::= ("" | ("." basic_number_digits{1, 16}))',
    'basic_number_5 ::= ("" | ([eE] basic_number_4 basic_number_digits{1, -1}))':
        'basic_number_5 ::= ("" | ([eE] basic_number_4 basic_number_digits{1, 3}))',
}
_FREE_WS = "[ \\n\\r\\t]*"
_STRING_LOOKAHEAD = "(=(" + _FREE_WS + " [,}\\]:]))"  # a lookahead, not output: left as it is
_BOUNDED_WS = "json_ws"
# One free whitespace character (tool-call JSON, `max_whitespace_cnt: 1`) becomes one space: a small model
# that loves newlines writes compact JSON, as `any_whitespace=False` grammars do.
_ONE_WS, _ONE_SPACE = '("" | ([ \\n\\r\\t]))', '("" | (" "))'
_BOUNDED_WS_RULE = 'json_ws ::= ("" | " " | ("\\n" [ \\t]{0, 20}))'


class GrammarState:
    """One row's matcher: what its generated tokens have matched so far."""

    __slots__ = ("matcher",)

    def __init__(self, matcher):
        self.matcher = matcher

    def accept(self, token_id: int) -> None:
        """Advance by the sampled token. The mask allowed only grammar tokens, so a refusal is a bug."""
        if not self.matcher.accept_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}, which its own mask allowed")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


GRAMMAR_CACHE_BYTES = 64 << 20  # compiled grammars kept for reuse (xgrammar's default: no limit)


def _tuple_items(schema: str) -> str:
    """Draft 4-7's tuple form, `"items": [A, B]` (with `additionalItems` for the rest), as 2020-12 writes it
    (`prefixItems`, `items`), which is the form xgrammar reads; llama.cpp and Pydantic v1 schemas still use the
    old one. Text that is not JSON is left for the compiler to refuse."""
    def fix(node):
        if isinstance(node, dict):
            node = {k: fix(v) for k, v in node.items()}
            if isinstance(node.get("items"), list):
                node["prefixItems"] = node.pop("items")
                if "additionalItems" in node:
                    node["items"] = node.pop("additionalItems")
            return node
        return [fix(v) for v in node] if isinstance(node, list) else node

    try:
        return json.dumps(fix(json.loads(schema)))
    except ValueError:
        return schema


class GrammarCompiler:
    """Compiles `GuidedDecoding` specs for one tokenizer; xgrammar caches compiled grammars by spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids or None)
        # bounded: a burst of distinct schemas evicts the least recently used compiled grammars
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES)

    def cache_bytes(self) -> int:
        """Bytes the compiled grammars in xgrammar's cache take (at most GRAMMAR_CACHE_BYTES)."""
        return int(self._compiler.get_cache_size_bytes())

    def compile(self, spec: GuidedDecoding):
        c, kind = self._compiler, spec.kind
        try:
            if kind == "json_object":
                return c.compile_grammar(bounded_json(self._xgr.Grammar.from_json_schema(
                    '{"type": "object"}', any_whitespace=_ANY_WHITESPACE, strict_mode=False)))
            if kind == "json_schema":
                return c.compile_grammar(bounded_json(self._xgr.Grammar.from_json_schema(
                    _tuple_items(spec.spec), any_whitespace=_ANY_WHITESPACE)))
            if kind == "regex":
                return c.compile_regex(spec.spec)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choices))
            if kind == "grammar":
                return c.compile_grammar(spec.spec)
            if kind == "structural_tag":
                return c.compile_grammar(bounded_json(self._xgr.Grammar.from_structural_tag(spec.spec)))
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar: RuntimeError with the converter's message
            raise InvalidRequest(f"{spec.param}: the {kind.replace('_', ' ')} cannot be compiled: "
                                 f"{_reason(exc)}", spec.param) from None
        raise InvalidRequest(f"{spec.param}: unknown guided decoding kind {kind!r}", spec.param)

    def state(self, compiled) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(compiled))


_bitmask: torch.Tensor | None = None  # reused across steps (engine thread only), grown on demand


def apply_masks(x: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """In place on x [B, V]: every token the grammar of row rows[j] forbids becomes -inf.

    One `fill_next_token_bitmask` per constrained row into a reused int32 bitmask (row i for logits
    row i), then one vectorised application over those rows in place; other rows are not touched."""
    global _bitmask
    import xgrammar as xgr

    B, V = x.shape
    if _bitmask is None or _bitmask.shape[0] < B or _bitmask.shape[1] != (V + 31) // 32:
        _bitmask = xgr.allocate_token_bitmask(max(B, 8), V)
    bitmask = _bitmask[:B]
    for i, st in zip(rows, states):
        st.matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(x, bitmask, vocab_size=V, indices=rows)


def bounded_json(grammar) -> str:
    """The EBNF of an xgrammar JSON grammar (schema, object or tool-call tags) with numbers and free
    whitespace bounded (see `_BOUNDED_RULES`). A rule xgrammar no longer prints as expected is left as it
    is (tests/engine/sample/test_grammar_bounds.py fails then, so a version bump cannot hide it)."""
    text = str(grammar).replace(_ONE_WS, _ONE_SPACE)
    for free, bounded in _BOUNDED_RULES.items():
        text = text.replace(free, bounded)
    if _FREE_WS in text:
        keep = "\x00lookahead\x00"
        text = text.replace(_STRING_LOOKAHEAD, keep).replace(_FREE_WS, _BOUNDED_WS).replace(keep, _STRING_LOOKAHEAD)
        text += "\n" + _BOUNDED_WS_RULE + "\n"
    return text


def _reason(exc: Exception) -> str:
    """xgrammar messages start with `[time] /path/file.cc:line: `; keep what follows."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    _, sep, tail = text.partition(".cc:")
    if sep:
        text = tail.split(": ", 1)[-1]
    return text[:500]
