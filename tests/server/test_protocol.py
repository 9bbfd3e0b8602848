"""The protocol layer alone: request schemas, their 400 mapping, response shapes, SSE framing, CLI sizes."""

import json

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from engine.api.errors import PromptTooLong, QueueFull
from engine.api.outputs import TokenLogprob
from server.cli import parse_size
from server.errors import APIError, param_from_loc, validation_error
from server.generation import formatter as completions
from server.generation.sse import DONE, encode_event, encode_named
from server.openai.chat import chat_logprobs
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.ops.protocol import DetokenizeRequest, TokenizeRequest
from server.sequences.protocol import SequenceCompletionRequest, SequenceCreateRequest


def as_400(model, data) -> APIError:
    """What the server answers for `data`: the RequestValidationError FastAPI would raise, mapped."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    return validation_error(RequestValidationError(errors))


@pytest.mark.parametrize("prompt,expected", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_shapes_normalise_to_a_list_of_prompts(prompt, expected):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt == expected


@pytest.mark.parametrize("prompt", [[], [1, "a"], [[1], []], [-1], 5, None, [1.5], [True], {"a": 1}])
def test_bad_prompts_are_400_on_prompt(prompt):
    err = as_400(CompletionRequest, {"prompt": prompt})
    assert err.status == 400 and err.param == "prompt", err.message


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("max_tokens", 0), ("max_tokens", "5"), ("max_tokens", 2.5),
    ("temperature", -0.1), ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5), ("n", 0), ("n", 1000),
    ("logprobs", 21), ("logprobs", True), ("stream", "yes"), ("stream", 1), ("seed", 1.5),
    ("presence_penalty", 3), ("frequency_penalty", -2.5), ("repetition_penalty", 0), ("min_p", 2),
    ("top_k", -2), ("stop", 5), ("stop", ["a", 1]), ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}),
    ("echo", "true"), ("ignore_eos", 0), ("user", 5),
])
def test_wrong_types_and_ranges_name_the_param(field, value):
    err = as_400(CompletionRequest, {"prompt": "x", field: value})
    assert err.status == 400
    assert err.param == field, (field, value, err.param, err.message)
    assert field in err.message


def test_unknown_fields_are_ignored_and_defaults_apply():
    req = CompletionRequest.model_validate({"prompt": "x", "best_of": 1, "whatever": {"a": 1}})
    assert req.n == 1 and not req.stream and req.max_tokens is None and req.stop is None


def test_known_fields_this_server_does_not_honour_are_400s():
    assert as_400(CompletionRequest, {"prompt": "x", "best_of": 3}).param == "best_of"
    assert as_400(CompletionRequest, {"prompt": "x", "use_beam_search": True}).param == "use_beam_search"


def test_float_fields_accept_ints_and_stop_accepts_a_string():
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 1, "stop": "\n"})
    assert req.temperature == 1.0 and req.stop == ["\n"]


def test_logit_bias_keys_become_token_ids():
    req = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"7": -100, "12": 5.5}})
    assert req.logit_bias_ids() == {7: -100.0, 12: 5.5}


def test_cross_field_errors_name_their_param():
    assert as_400(CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}).param == \
        "stream_options"
    assert CompletionRequest.model_validate({"prompt": "x", "echo": True, "logprobs": 2, "max_tokens": 0})
    assert as_400(CompletionRequest, {"prompt": "x", "max_tokens": 0}).param == "max_tokens"
    assert as_400(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                          "top_logprobs": 2}).param == "top_logprobs"
    assert as_400(SequenceCompletionRequest, {"n": 2}).param == "n"
    assert as_400(SequenceCreateRequest, {}).param == "prompt"
    assert as_400(SequenceCreateRequest, {"prompt": "a", "messages": [{"role": "user"}]}).param == "prompt"


def test_chat_messages_content_parts_and_errors():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ], "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 3})
    assert req.messages[1].content == "ab" and req.max_new_tokens() == 4
    assert req.messages[0].as_template_dict() == {"role": "system", "content": "be brief"}
    err = as_400(ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]})
    assert err.param == "messages[0].role"
    err = as_400(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert err.param == "messages[0].content" and "text" in err.message
    assert as_400(ChatCompletionRequest, {"messages": []}).param == "messages"
    assert as_400(ChatCompletionRequest, {}).param == "messages"


def test_tokenize_and_detokenize_requests():
    assert TokenizeRequest.model_validate({"prompt": "hi"}).add_special_tokens
    assert as_400(TokenizeRequest, {"prompt": [1, 2]}).param == "prompt"
    assert as_400(DetokenizeRequest, {"tokens": [1, -2]}).param == "tokens"
    assert as_400(DetokenizeRequest, {"tokens": "12"}).param == "tokens"


def test_json_and_body_errors_are_400_with_a_hint():
    err = validation_error(RequestValidationError([{"type": "json_invalid", "loc": ("body", 3),
                                                    "msg": "JSON decode error", "ctx": {"error": "Expecting value"}}]))
    assert err.status == 400 and "JSON" in err.message
    err = validation_error(RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}]))
    assert err.status == 400 and "body" in err.message


def test_param_paths():
    assert param_from_loc(("body", "messages", 0, "content")) == "messages[0].content"
    assert param_from_loc(("body",)) is None
    assert param_from_loc(("path", "seq_id")) == "seq_id"


def test_engine_errors_keep_status_code_and_param():
    err = APIError.from_engine(PromptTooLong("too long", "max_tokens"))
    assert (err.status, err.param, err.code) == (400, "max_tokens", "context_length_exceeded")
    assert err.body() == {"error": {"message": "too long", "type": "invalid_request_error",
                                    "param": "max_tokens", "code": "context_length_exceeded"}}
    busy = APIError.from_engine(QueueFull("full"))
    assert busy.status == 429 and busy.headers() == {"Retry-After": "1"}
    assert busy.body()["error"]["type"] == "rate_limit_error"


def test_logprob_shapes():
    strs = {1: "he", 2: "llo", 3: "é"}.__getitem__
    lps = [TokenLogprob(1, -0.5, [(1, -0.5), (3, -1.0)]), TokenLogprob(2, -2.0, [(3, -0.1)])]
    legacy = completions.completion_logprobs(lps, strs, 4)
    assert legacy == {"tokens": ["he", "llo"], "token_logprobs": [-0.5, -2.0],
                      "top_logprobs": [{"he": -0.5, "é": -1.0}, {"é": -0.1, "llo": -2.0}], "text_offset": [4, 6]}
    chat = chat_logprobs(lps[:1], strs)
    assert chat["content"][0] == {"token": "he", "logprob": -0.5, "bytes": [104, 101], "top_logprobs": [
        {"token": "he", "logprob": -0.5, "bytes": [104, 101]}, {"token": "é", "logprob": -1.0, "bytes": [195, 169]}]}


def test_usage_and_chunk_shapes():
    assert completions.usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    c = completions.chunk("chat.completion.chunk", "id1", 5, "m", [], with_usage=True)
    assert c["usage"] is None and c["object"] == "chat.completion.chunk"
    assert "usage" not in completions.chunk("text_completion", "id1", 5, "m", [], with_usage=False)
    u = completions.usage_chunk("text_completion", "id1", 5, "m", completions.usage(1, 1))
    assert u["choices"] == [] and u["usage"]["total_tokens"] == 2


def test_sse_framing_keeps_non_ascii_whole():
    assert encode_event(DONE) == b"data: [DONE]\n\n"
    raw = encode_event({"text": "héllo 世界"})
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n") and raw.count(b"\n") == 2
    assert json.loads(raw[6:]) == {"text": "héllo 世界"}


def test_an_event_stays_one_line_for_every_line_splitter():
    """A streamed token may hold U+0085, U+2028 or U+2029, which JSON leaves raw but str.splitlines and
    httpx's iter_lines take for line ends (a CI run split a tiny model's chunk there: JSONDecodeError).
    Escaped, each event is one line for them too and still decodes to the same text."""
    text = "a\x85b\u2028c\u2029d\x0be\x1cf 世界"
    for raw, prefix in ((encode_event({"text": text}), b"data: "),
                        (encode_named(("response.output_text.delta", {"delta": text})), b"data: ")):
        lines = raw.decode().splitlines()
        assert raw.endswith(b"\n\n") and len([line for line in lines if line]) == raw.count(b"\n") - 1
        data = next(line for line in lines if line.startswith(prefix.decode()))
        assert text in json.loads(data[len(prefix):]).values()


@pytest.mark.parametrize("text,value", [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                        ("4096", 4096), ("64k", 64_000)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["two gigs", "-1GiB", "0", "3XB"])
def test_parse_size_rejects(text):
    with pytest.raises(Exception, match="size"):
        parse_size(text)


def test_sequence_completion_empty_prompt_means_append_nothing():
    req = SequenceCompletionRequest.model_validate({"prompt": "", "messages": [{"role": "user", "content": "x"}]})
    assert req.prompt is None and req.messages[0].content == "x"


def test_explicit_nulls_mean_defaults():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "assistant", "content": None}], "n": None,
                                                "stream": None, "temperature": None, "logprobs": None})
    assert req.n == 1 and req.stream is False and req.temperature is None and req.logprobs is False
    assert as_400(CompletionRequest, {"prompt": None}).param == "prompt"
