"""JSON grammars bound numbers and free whitespace (engine/sample/grammar.py `bounded_json`), so a model that
loves one digit or one newline still closes its JSON before max_tokens, as llama.cpp's grammars do.

The model here is pushed, by a +100 logit bias, towards the very token that would run forever without the
bounds; the grammar mask is what ends the run.
"""

import json
import re

import pytest
from engine_support import Collector, drain, make_engine, shared_tokenizer, text_model

from engine.api.sampling_params import GuidedDecoding, SamplingParams

INTEGER = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
NUMBER = json.dumps({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})
TOOL_TAG = json.dumps({"type": "structural_tag", "format": {
    "type": "tag", "begin": '<tool_call>{"name": "f", "arguments": ',
    "content": {"type": "json_schema", "json_schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                       "required": ["a"]}},
    "end": "}</tool_call>"}})


@pytest.fixture(scope="module")
def engine():
    tokenizer = shared_tokenizer()
    return make_engine(model=text_model(tokenizer), tokenizer=tokenizer)


def _run(engine, guided: GuidedDecoding, favour: str, max_tokens: int = 120) -> tuple[str, str]:
    tokenizer = engine.tokenizer
    favoured = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(favour))
    assert len(favoured) == 1, f"{favour!r} should be one token of the tiny tokenizer"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, guided=guided, logit_bias={favoured[0]: 100.0})
    out = Collector()
    engine.add_request("r", tokenizer.encode("x"), params, out)
    drain(engine)
    return out.text(), out.finish[0]


@pytest.mark.parametrize("schema, key, favour", [(INTEGER, "n", "1"), (NUMBER, "x", "1")])
def test_a_favoured_digit_stops_at_sixteen(engine, schema, key, favour):
    text, finish = _run(engine, GuidedDecoding("json_schema", schema), favour)
    assert finish == "stop", text
    json.loads(text)[key]  # valid JSON with the key
    integer_part = re.search(r":\s*-?(\d+)", text).group(1)
    assert set(integer_part) == {"1"} and len(integer_part) == 16, text


def test_a_favoured_newline_cannot_fill_a_tool_call(engine):
    text, finish = _run(engine, GuidedDecoding("structural_tag", TOOL_TAG, param="tool_choice"), "\n")
    assert finish == "stop", text
    assert text.count("\n") <= 8, text  # at most one newline per whitespace slot of the call's JSON
    args = text.removeprefix('<tool_call>{"name": "f", "arguments": ').removesuffix("}</tool_call>")
    assert json.loads(args)["a"] is not None


def test_every_bounded_rule_is_found_in_xgrammars_output():
    """If xgrammar ever prints its JSON rules differently, the bounds would silently vanish: fail instead."""
    import xgrammar as xgr

    from engine.sample import grammar

    text = str(xgr.Grammar.from_json_schema(NUMBER, any_whitespace=True))
    for free in grammar._BOUNDED_RULES:
        assert free in text
    assert grammar._FREE_WS in text and grammar._STRING_LOOKAHEAD in text
    bounded = grammar.bounded_json(xgr.Grammar.from_json_schema(NUMBER, any_whitespace=True))
    assert grammar._FREE_WS not in bounded.replace(grammar._STRING_LOOKAHEAD, "")
