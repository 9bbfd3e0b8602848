"""OpenAI's `chat.completion` / `chat.completion.chunk` shapes (`ChatFormatter`, built on
`server.openai.completions.Formatter`); with tools offered, the text is split into content and
`tool_calls` by `server.openai.tools`."""

from engine.api.outputs import CompletionOutput, TokenLogprob
from server.openai.completions import ChoiceState, Formatter, TokenStr
from server.openai.tools import ToolCallStream, parse_tool_calls


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
            "choices": choices, "usage": use, "system_fingerprint": None}


def chat_choice(c: ChoiceState, token_str: TokenStr, want_logprobs: bool, content: str | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    """`content`/`tool_calls`: the text split by `server.openai.tools` when tools were offered (else the text)."""
    calls = tool_calls or []
    finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
    return {
        "index": c.index,
        "message": {"role": "assistant", "content": c.text if content is None and not calls else content,
                    "refusal": None, "tool_calls": calls},
        "logprobs": chat_logprobs(c.logprobs, token_str) if want_logprobs else None,
        "finish_reason": finish,
        "stop_reason": c.stop_reason,
    }


class ChatFormatter(Formatter):
    """Chat shapes. With `tools` (tools offered, tool_choice not none) the text is split into content
    and `tool_calls` (server.openai.tools), whole or streamed, and a choice that stopped after calling tools
    ends with finish_reason `tool_calls`."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, tools: bool = False, parallel_tool_calls: bool = True, **kw):
        super().__init__(*args, **kw)
        self.tools, self.parallel = tools, parallel_tool_calls
        self.tool_streams = {st.index: ToolCallStream(parallel_tool_calls) for st in self.states.values()} if tools else {}

    def final(self) -> dict:
        choices = []
        for s in self.ordered():
            content, calls = parse_tool_calls(s.text, self.parallel) if self.tools else (s.text, [])
            choices.append(chat_choice(s, self.token_str, self.want_logprobs, content, calls))
        return chat_response(self.run.request_id, self.created, self.model, choices,
                             self.total_usage())

    def opening_chunks(self) -> list[dict]:
        return [self._chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]) for s in self.ordered()]

    def delta_chunk(self, st: ChoiceState, co: CompletionOutput, first: bool) -> dict | None:
        lp = chat_logprobs(co.logprobs or [], self.token_str) if self.want_logprobs else None
        finish = co.finish_reason
        if not self.tools:
            delta = {"content": co.text} if co.text or not finish else {}
        else:
            stream = self.tool_streams[st.index]
            done = len(stream.calls)
            text, calls = stream.feed(co.text)
            if finish:
                text += stream.close()
            delta = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = [{"index": done + j, **c} for j, c in enumerate(calls)]
            if finish == "stop" and stream.calls:
                finish = "tool_calls"
            if not delta and not finish and lp is None:
                return None  # held back: it may be the start of a tool call
        return self._chunk([{"index": st.index, "delta": delta, "logprobs": lp,
                             "finish_reason": finish, "stop_reason": co.stop_reason}])
