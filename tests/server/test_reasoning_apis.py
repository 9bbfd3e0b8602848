"""Reasoning through `/v1/responses` and `/v1/messages` with the real `openai` and `anthropic` SDKs: a tiny
scripted model (tests/tiny_models.py: it writes "So</think>Yes!" after a Qwen3-style thinking prompt)
behind a template with a thinking switch. The `<think>` part becomes a `reasoning` output item (streamed
as `response.reasoning_text.*` events) and a `thinking` block (streamed as `thinking_delta`s); whole and
streamed agree; the switch is reached by `reasoning.effort` and `thinking`; reasoning sent back (reasoning
items, thinking blocks) is accepted."""

import anthropic
import openai
import pytest
from http_support import LiveServer
from tiny_models import save_scripted_model_dir
from tool_support import THINK

REASONING, ANSWER = "So", "Yes!"
USER = [{"role": "user", "content": "Is it so?"}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    return save_scripted_model_dir(tmp_path_factory.mktemp("scripted"), THINK, "<think>\n",
                                   f"{REASONING}</think>{ANSWER}")


@pytest.fixture(scope="module")
def srv(scripted):
    with LiveServer(scripted[0], n_cells=1024) as server:
        yield server


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)


GREEDY = {"model": "m", "temperature": 0, "max_output_tokens": 16}


def test_responses_reasoning_item_whole(srv, oai, scripted):
    r = oai.responses.create(input="Is it so?", **GREEDY)
    assert r.status == "completed" and [i.type for i in r.output] == ["reasoning", "message"]
    thought = r.output[0]
    assert thought.summary == [] and [(c.type, c.text) for c in thought.content] == [("reasoning_text", REASONING)]
    assert r.output_text == ANSWER
    # "So" and "</think>" are reasoning tokens; "Yes!" and EOS are not
    thinking = srv.ctx.tokens.tok.encode(REASONING, add_special_tokens=False)
    assert r.usage.output_tokens == len(scripted[1]) + 1
    assert r.usage.output_tokens_details.reasoning_tokens == len(thinking) + 1


def test_responses_reasoning_streamed_as_typed_events(oai):
    whole = oai.responses.create(input="Is it so?", **GREEDY)
    events = list(oai.responses.create(input="Is it so?", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == REASONING and done.output_index == 0 and done.content_index == 0
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert final.output_text == ANSWER and [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == whole.output[0].content[0].text
    assert final.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens_details.reasoning_tokens
    # the SDK's own accumulator puts the same items together
    with oai.responses.stream(input="Is it so?", **GREEDY) as stream:
        accumulated = stream.get_final_response()
    assert accumulated.output_text == ANSWER and accumulated.output[0].type == "reasoning"


def test_responses_effort_reaches_the_thinking_switch(oai):
    on = oai.responses.create(input="Is it so?", **GREEDY)
    off = oai.responses.create(input="Is it so?", reasoning={"effort": "none"}, **GREEDY)
    high = oai.responses.create(input="Is it so?", reasoning={"effort": "high", "summary": "auto"},
                                include=["reasoning.encrypted_content"], store=False, **GREEDY)
    # effort none renders the template's empty <think></think>: a longer prompt, and no reasoning item
    assert off.usage.input_tokens > on.usage.input_tokens == high.usage.input_tokens
    assert "reasoning" not in [i.type for i in off.output] and off.reasoning.effort == "none"
    assert high.reasoning.effort == "high" and high.reasoning.summary == "auto"
    assert high.output[0].type == "reasoning"


def test_responses_continue_and_send_reasoning_back(oai):
    r1 = oai.responses.create(input="Is it so?", **GREEDY)
    r2 = oai.responses.create(input="Sure?", previous_response_id=r1.id, **GREEDY)
    assert r2.status == "completed" and r2.output_text == ANSWER and r2.output[0].type == "reasoning"
    assert oai.responses.retrieve(r2.id).output[0].content[0].text == REASONING
    # the client keeps the conversation itself: earlier output items (a reasoning item among them) as input
    items = [{"role": "user", "content": "Is it so?"}, *[i.model_dump(exclude_none=True) for i in r1.output],
             {"role": "user", "content": "Sure?"}]
    r3 = oai.responses.create(input=items, **GREEDY)
    assert r3.output_text == ANSWER
    listed = list(oai.responses.input_items.list(r3.id, order="asc"))
    assert [i.type for i in listed] == ["message", "reasoning", "message", "message"]
    assert listed[1].id == r1.output[0].id and listed[1].content[0].text == REASONING


def test_messages_thinking_block_whole_and_streamed(claude):
    kw = {"model": "m", "max_tokens": 16, "messages": USER, "extra_body": {"temperature": 0},
          "thinking": {"type": "enabled", "budget_tokens": 1024}}
    m = claude.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.stop_reason == "end_turn"
    assert m.content[0].thinking == REASONING and m.content[0].signature == "" and m.content[1].text == ANSWER
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == REASONING
    assert "".join(d.text for d in deltas if d.type == "text_delta") == ANSWER
    assert final.model_dump()["content"] == m.model_dump()["content"]
    hidden = claude.messages.create(**{**kw, "thinking": {"type": "enabled", "budget_tokens": 1024,
                                                          "display": "omitted"}})
    assert hidden.content[0].type == "thinking" and hidden.content[0].thinking == ""


def test_messages_thinking_switch_and_history(claude):
    def count(thinking):
        return claude.messages.count_tokens(model="m", messages=USER, thinking=thinking).input_tokens

    assert count({"type": "disabled"}) > count({"type": "enabled", "budget_tokens": 1024}) == count({"type": "adaptive"})
    off = claude.messages.create(model="m", max_tokens=4, messages=USER, thinking={"type": "disabled"},
                                 extra_body={"temperature": 0})
    assert "thinking" not in [b.type for b in off.content]
    # an earlier reply's thinking blocks (and redacted ones) are taken back in the history
    turns = [*USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": REASONING, "signature": ""},
        {"type": "redacted_thinking", "data": "xyz"}, {"type": "text", "text": ANSWER}]},
        {"role": "user", "content": "Sure?"}]
    again = claude.messages.create(model="m", max_tokens=16, messages=turns, extra_body={"temperature": 0})
    assert [b.type for b in again.content] == ["thinking", "text"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="m", max_tokens=4, messages=USER, thinking={"type": "sometimes"})
