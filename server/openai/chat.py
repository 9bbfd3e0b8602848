"""OpenAI's `chat.completion` / `chat.completion.chunk` shapes (`ChatFormatter`, built on
`server.generation.formatter.Formatter`). A reply is split, whole or streamed, first into reasoning
(`server.generation.reasoning`, when the template speaks `<think>`) and answer, then the answer into
content and `tool_calls` (`server.generation.tools`, when tools were offered): streamed calls arrive as
OpenAI's deltas (the first with id, type, name and `"arguments": ""`, then argument fragments)."""

from dataclasses import dataclass

from engine.api.outputs import CompletionOutput, TokenLogprob
from server.generation.formatter import SYSTEM_FINGERPRINT, ChoiceState, Formatter, TokenStr
from server.generation.reasoning import ReasoningSplitter
from server.generation.tools import HERMES, ToolFormat


def _chat_entry(token_id: int, logprob: float, token_str: TokenStr) -> dict:
    s = token_str(token_id)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(lps: list[TokenLogprob], token_str: TokenStr) -> dict:
    content = []
    for lp in lps:
        entry = _chat_entry(lp.token_id, lp.logprob, token_str)
        entry["top_logprobs"] = [_chat_entry(t, v, token_str) for t, v in lp.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def chat_response(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": use, "system_fingerprint": SYSTEM_FINGERPRINT}


def chat_choice(c: ChoiceState, token_str: TokenStr, want_logprobs: bool, content: str | None = None,
                tool_calls: list[dict] | None = None, reasoning: str | None = None,
                with_reasoning: bool = False, parsed: bool = False) -> dict:
    """`content`/`tool_calls`: the text split by `server.generation.tools` when tools were offered (else the
    text; `parsed`: the split was made, so a None content stays None); `reasoning`: the `<think>` part,
    in `reasoning_content` and `reasoning` when `with_reasoning`."""
    calls = tool_calls or []
    finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
    if content is None and not calls and not parsed:
        content = c.text
    message = {"role": "assistant", "content": content, "refusal": None}
    if calls:  # OpenAI omits the field when there are none
        message["tool_calls"] = calls
    if with_reasoning:
        message["reasoning_content"] = message["reasoning"] = reasoning
    return {
        "index": c.index,
        "message": message,
        "logprobs": chat_logprobs(c.logprobs, token_str) if want_logprobs else None,
        "finish_reason": finish,
        "stop_reason": c.stop_reason,
    }


@dataclass(frozen=True)
class ToolSetup:
    """How a chat request's replies are read for tool calls."""

    fmt: ToolFormat = HERMES
    tools: tuple = ()
    parallel: bool = True
    forced: bool = False  # required/named: the grammar allows only calls

    def parser(self):
        return self.fmt.new_parser(list(self.tools), parallel=self.parallel, forced=self.forced)


class ChatFormatter(Formatter):
    """Chat shapes. With `tools` (tools offered, tool_choice not none) the text is split into content
    and `tool_calls`, whole or streamed, and a choice that stopped after calling tools ends with
    finish_reason `tool_calls`. With `reasoning` the `<think>` part goes to `reasoning_content`
    (`reasoning_starts`: the prompt already opened it)."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, tools: bool | ToolSetup = False, parallel_tool_calls: bool = True,
                 reasoning: bool = False, reasoning_starts: bool = False, **kw):
        super().__init__(*args, **kw)
        if tools is True:
            tools = ToolSetup(parallel=parallel_tool_calls)
        self.setup: ToolSetup | None = tools or None
        self.tools, self.parallel = bool(tools), parallel_tool_calls
        self.reasoning, self.reasoning_starts = reasoning, reasoning_starts
        self.tool_streams = {st.index: self.setup.parser() for st in self.states.values()} if self.setup else {}
        self.splitters = {st.index: ReasoningSplitter(reasoning_starts) for st in self.states.values()} if reasoning else {}

    def final(self) -> dict:
        choices = []
        for s in self.ordered():
            reasoning, text = ReasoningSplitter(self.reasoning_starts).split(s.text) if self.reasoning else (None, s.text)
            content, calls = self.setup.parser().parse(text) if self.setup else (text, [])
            choices.append(chat_choice(s, self.token_str, self.want_logprobs, content or None, calls, reasoning,
                                       with_reasoning=self.reasoning, parsed=True))
        return chat_response(self.run.request_id, self.created, self.model, choices,
                             self.total_usage())

    def opening_chunks(self) -> list[dict]:
        return [self._chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]) for s in self.ordered()]

    def delta_chunk(self, st: ChoiceState, co: CompletionOutput, first: bool) -> dict | None:
        lp = chat_logprobs(co.logprobs or [], self.token_str) if self.want_logprobs else None
        finish = co.finish_reason
        if not self.tools and not self.reasoning:
            delta = {"content": co.text} if co.text or not finish else {}
            return self._chunk([{"index": st.index, "delta": delta, "logprobs": lp,
                                 "finish_reason": finish, "stop_reason": co.stop_reason}])
        text, reasoning = co.text, ""
        if self.reasoning:
            splitter = self.splitters[st.index]
            reasoning, text = splitter.feed(text)
            if finish:
                r, t = splitter.close()
                reasoning, text = reasoning + r, text + t
        calls: list[dict] = []
        if self.tools:
            stream = self.tool_streams[st.index]
            text, calls = stream.feed(text)
            if finish:
                t, more = stream.close()
                text, calls = text + t, calls + more
            if finish == "stop" and stream.calls:
                finish = "tool_calls"
        delta: dict = {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = _merged(calls)
        if not delta and not finish and lp is None:
            return None  # held back: it may be the start of a tag or a call
        return self._chunk([{"index": st.index, "delta": delta, "logprobs": lp,
                             "finish_reason": finish, "stop_reason": co.stop_reason}])


def _merged(deltas: list[dict]) -> list[dict]:
    """Consecutive argument fragments of one call in one chunk become one fragment (a call's first delta,
    with its id and name, stays on its own)."""
    out: list[dict] = []
    for d in deltas:
        prev = out[-1] if out else None
        if prev is not None and "id" not in d and "id" not in prev and prev["index"] == d["index"]:
            prev["function"] = {"arguments": prev["function"]["arguments"] + d["function"]["arguments"]}
        else:
            out.append({**d, "function": dict(d["function"])})
    return out
