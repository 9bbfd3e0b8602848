"""Anthropic's Messages shapes: the `message` object and its stream events, as plain dicts.

Content is a `thinking` block (the reply's `<think>` part, when the template speaks `<think>`; its
`signature` is empty: nothing here checks one), `text` blocks and `tool_use` blocks (the model's calls,
split from its text by the shared tool parser, `server.generation.toolcalls`). Streamed, the events come in Anthropic's order:
`message_start`, then per block `content_block_start`, `content_block_delta` (`thinking_delta`,
`text_delta`, or `input_json_delta`s: a call's input as it is generated), `content_block_stop`, then
`message_delta` (stop_reason, stop_sequence, usage)
and `message_stop`. stop_reason: `end_turn` (EOS), `stop_sequence` (with the one matched),
`max_tokens`, `tool_use` (the reply ended after calling tools).
"""

import json

from server.generation.output import Output


def usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    """Anthropic counts cache reads apart: input_tokens are the prompt tokens that were computed."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def stop_of(output: Output, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if output.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(output.stop_reason, str):
        return "stop_sequence", output.stop_reason
    return "end_turn", None


def tool_use(call: dict) -> dict:
    args = call["function"]["arguments"]
    try:
        value = json.loads(args)
    except ValueError:
        value = {}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": value if isinstance(value, dict) else {}}


class MessageBuilder:
    def __init__(self, mid: str, model: str, show_thinking: bool = True):
        self.mid, self.model, self.show_thinking = mid, model, show_thinking
        self.blocks: list[dict] = []
        self.text_open = False  # the last block is a text (or thinking) block still streaming
        self.open_tools: dict[int, tuple[str, int]] = {}  # streaming: call index -> (call id, block index)

    def message(self, content: list[dict], stop: tuple[str | None, str | None], use: dict) -> dict:
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": use}

    def final(self, output: Output, content: str, calls: list[dict], use: dict, reasoning: str | None = None) -> dict:
        blocks = [self._thinking(reasoning)] if reasoning is not None else []
        blocks += [{"type": "text", "text": content}] if content or not (calls or blocks) else []
        blocks += [tool_use(c) for c in calls]
        return self.message(blocks, stop_of(output, bool(calls)), use)

    # --- stream events
    def opening(self, use: dict) -> list[tuple[str, dict]]:
        return [("message_start", {"type": "message_start", "message": self.message([], (None, None), use)})]

    def _thinking(self, text: str) -> dict:
        return {"type": "thinking", "thinking": text if self.show_thinking else "", "signature": ""}

    def thinking_delta(self, text: str) -> list[tuple[str, dict]]:
        events = []
        if not (self.text_open and self.blocks[-1]["type"] == "thinking"):
            events += self._stop_text()
            events.append(self._start(self._thinking("")))
            self.text_open = True
        if self.show_thinking:
            events.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                   "delta": {"type": "thinking_delta", "thinking": text}}))
        return events

    def text_delta(self, text: str) -> list[tuple[str, dict]]:
        if not text:
            return []
        events = self._stop_text() if self.blocks and self.blocks[-1]["type"] == "thinking" else []
        if not self.text_open:
            events.append(self._start({"type": "text", "text": ""}))
            self.text_open = True
        events.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                               "delta": {"type": "text_delta", "text": text}}))
        return events

    def streamed(self, events: list[tuple]) -> list[tuple[str, dict]]:
        """The events of a `ToolStream`'s output: text deltas, and per call a `tool_use` block whose
        `input_json_delta`s are the arguments as generated."""
        out: list[tuple[str, dict]] = []
        for ev in events:
            if ev[0] == "reasoning":
                out += self.thinking_delta(ev[1])
            elif ev[0] == "text":
                out += self.text_delta(ev[1])
            elif ev[0] == "begin":
                out += self._stop_text()
                out.append(self._start(tool_use({**ev[1], "function": {**ev[1]["function"], "arguments": "{}"}})))
                self.open_tools[ev[1]["index"]] = (ev[1]["id"], len(self.blocks) - 1)
            elif ev[0] == "arguments":
                index = self.open_tools[ev[1]][1]
                out.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                    "delta": {"type": "input_json_delta", "partial_json": ev[2]}}))
            else:
                key = next(k for k, (call_id, _) in self.open_tools.items() if call_id == ev[1]["id"])
                out.append(("content_block_stop", {"type": "content_block_stop",
                                                   "index": self.open_tools.pop(key)[1]}))
        return out

    def closing(self, output: Output, called: bool, use: dict) -> list[tuple[str, dict]]:
        events = self._stop_text()
        stop_reason, stop_sequence = stop_of(output, called)
        return events + [("message_delta", {"type": "message_delta", "usage": use,
                                            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}}),
                         ("message_stop", {"type": "message_stop"})]

    def _start(self, block: dict) -> tuple[str, dict]:
        self.blocks.append(block)
        return "content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                       "content_block": block}

    def _stop_text(self) -> list[tuple[str, dict]]:
        if not self.text_open:
            return []
        self.text_open = False
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]
