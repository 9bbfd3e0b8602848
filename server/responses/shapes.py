"""OpenAI's Responses shapes: the `response` object and its typed stream events, built as plain dicts.

`ResponseBuilder` turns one generation into output items: a `reasoning` item (its `<think>` part, as one
`reasoning_text` content part, when the template speaks `<think>` and the model thought), a `message` item
holding one `output_text` part (the text, tool-call markup taken out), then one `function_call` item per
call the model made.
Streamed, the events come in the order the `openai` SDK's accumulator expects, each with its
`sequence_number` (0, 1, 2, ...): `response.created`, `response.in_progress`; for the reasoning
`response.output_item.added`, `response.content_part.added`, `response.reasoning_text.delta`...,
`response.reasoning_text.done`, `response.content_part.done`, `response.output_item.done`; for the message
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta`...,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`; for a call
`response.output_item.added`, `response.function_call_arguments.delta`... (the arguments as generated),
`response.function_call_arguments.done`, `response.output_item.done`; then `response.completed`
(`response.incomplete` when `max_output_tokens` cut it or it was cancelled, `response.failed` on an
engine error). Statuses: completed, incomplete (`incomplete_details.reason: max_output_tokens`),
cancelled, failed.
"""

import time
import uuid

from server.generation.output import Output
from server.responses.protocol import ResponsesRequest


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(input_tokens: int, cached: int, output_tokens: int, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def status_of(output: Output) -> tuple[str, dict | None, dict | None]:
    """(status, incomplete_details, error) of a finished generation."""
    if output.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if output.finish_reason == "cancelled":
        return "cancelled", None, None
    if output.finish_reason == "error":
        return "failed", None, {"code": "server_error", "message": f"generation failed: {output.error}"}
    return "completed", None, None


def status_item(status: str) -> str:
    """An item's status at the end of a response with `status`."""
    return "incomplete" if status == "incomplete" else "completed"


class ResponseBuilder:
    def __init__(self, rid: str, body: ResponsesRequest, *, model: str, max_output_tokens: int):
        self.rid, self.body, self.model, self.max_output_tokens = rid, body, model, max_output_tokens
        self.created_at = int(time.time())
        self.items: list[dict] = []  # output items, in order
        self.message: dict | None = None  # the open message item (streaming)
        self.thought: dict | None = None  # the open reasoning item (streaming)
        self.open_calls: dict[int, tuple[dict, int]] = {}  # streaming: call index -> (its item, output_index)
        self.seq = 0

    # --- the response object
    def response(self, status: str, use: dict | None = None, incomplete: dict | None = None,
                 error: dict | None = None) -> dict:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        text_format = {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)
        tool_choice = b.tool_choice if isinstance(b.tool_choice, str) or b.tool_choice is None \
            else b.tool_choice.model_dump()
        return {
            "id": self.rid, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": incomplete, "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens, "model": self.model, "output": list(self.items),
            "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None,
                          "summary": (b.reasoning.summary or b.reasoning.generate_summary) if b.reasoning else None},
            "store": b.store,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": text_format}, "tool_choice": tool_choice or ("auto" if b.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
            "top_p": 1.0 if b.top_p is None else b.top_p, "truncation": "disabled", "usage": use,
            "user": b.user, "metadata": b.metadata or {},
        }

    def final(self, output: Output, content: str, calls: list[dict], use: dict, reasoning: str | None = None) -> dict:
        """The whole response (non-streaming): the items from the split text, then the object."""
        status, incomplete, error = status_of(output)
        if reasoning is not None:
            self.items.append(self._reasoning(reasoning, "completed" if content or calls else status_item(status)))
        if content or not calls:
            self.items.append(self._message(content, status_item(status)))
        self.items += [self._call(c) for c in calls]
        return self.response(status, use, incomplete, error)

    # --- stream events
    def event(self, kind: str, **fields) -> tuple[str, dict]:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return kind, out

    def opening(self) -> list[tuple[str, dict]]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def text_delta(self, text: str) -> list[tuple[str, dict]]:
        if not text:
            return []
        events = self._close_reasoning("completed")
        events += self._open_message() if self.message is None else []
        self.message["content"][0]["text"] += text
        events.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                 output_index=len(self.items), content_index=0, delta=text, logprobs=[]))
        return events

    def streamed(self, events: list[tuple]) -> list[tuple[str, dict]]:
        """The events of a `ToolStream`'s output: text deltas, and per call `response.output_item.added`,
        `response.function_call_arguments.delta` (each fragment as generated), `...arguments.done` and
        `response.output_item.done`."""
        out: list[tuple[str, dict]] = []
        for ev in events:
            if ev[0] == "reasoning":
                out += self.reasoning_delta(ev[1])
            elif ev[0] == "text":
                out += self.text_delta(ev[1])
            elif ev[0] == "begin":
                out += self._call_begin(ev[1])
            elif ev[0] == "arguments":
                out += self._call_arguments(ev[1], ev[2])
            else:
                out += self._call_end(ev[1])
        return out

    def _call_begin(self, header: dict) -> list[tuple[str, dict]]:
        events = self._close_reasoning("completed") + self._close_message("completed")
        item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": header["id"],
                "name": header["function"]["name"], "arguments": ""}
        index = len(self.items)
        self.items.append(item)
        self.open_calls[header["index"]] = (item, index)
        return events + [self.event("response.output_item.added", output_index=index, item=dict(item))]

    def _call_arguments(self, call_index: int, fragment: str) -> list[tuple[str, dict]]:
        item, index = self.open_calls[call_index]
        item["arguments"] += fragment
        return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=fragment)]

    def _call_end(self, call: dict) -> list[tuple[str, dict]]:
        key = next(k for k, (item, _) in self.open_calls.items() if item["call_id"] == call["id"])
        item, index = self.open_calls.pop(key)
        item.update(arguments=call["function"]["arguments"], status="completed")
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           arguments=item["arguments"], name=item["name"]),
                self.event("response.output_item.done", output_index=index, item=dict(item))]

    def closing(self, output: Output, use: dict) -> list[tuple[str, dict]]:
        status, incomplete, error = status_of(output)
        events = self._close_reasoning(status_item(status)) + self._close_message(status_item(status))
        if not self.items or self.items[-1]["type"] == "reasoning":
            # nothing was said: still one (empty) message, as the non-streaming answer has
            events += self._open_message()
            events += self._close_message(status_item(status))
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(status, "response.incomplete")
        return events + [self.event(kind, response=self.response(status, use, incomplete, error))]

    # --- items
    def _message(self, text: str, status: str) -> dict:
        return {"id": _item_id("msg"), "type": "message", "role": "assistant", "status": status,
                "content": [self._part(text)]}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def _call(call: dict) -> dict:
        return {"id": _item_id("fc"), "type": "function_call", "status": "completed", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"]}

    def _open_message(self) -> list[tuple[str, dict]]:
        self.message = self._message("", "in_progress")
        index = len(self.items)
        return [self.event("response.output_item.added", output_index=index, item={**self.message, "content": []}),
                self.event("response.content_part.added", item_id=self.message["id"], output_index=index,
                           content_index=0, part=self._part(""))]

    def _close_message(self, status: str) -> list[tuple[str, dict]]:
        msg, self.message = self.message, None
        if msg is None:
            return []
        index = len(self.items)
        msg["status"] = status
        part = msg["content"][0]
        self.items.append(msg)
        return [self.event("response.output_text.done", item_id=msg["id"], output_index=index, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=msg["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=msg)]

    # --- the reasoning item
    @staticmethod
    def _reasoning(text: str, status: str) -> dict:
        return {"id": _item_id("rs"), "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}

    def reasoning_delta(self, text: str) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        if self.thought is None:
            self.thought = self._reasoning("", "in_progress")
            index = len(self.items)
            events += [self.event("response.output_item.added", output_index=index,
                                  item={**self.thought, "content": []}),
                       self.event("response.content_part.added", item_id=self.thought["id"], output_index=index,
                                  content_index=0, part={"type": "reasoning_text", "text": ""})]
        self.thought["content"][0]["text"] += text
        return events + [self.event("response.reasoning_text.delta", item_id=self.thought["id"],
                                    output_index=len(self.items), content_index=0, delta=text)]

    def _close_reasoning(self, status: str) -> list[tuple[str, dict]]:
        item, self.thought = self.thought, None
        if item is None:
            return []
        index = len(self.items)
        item["status"] = status
        part = item["content"][0]
        self.items.append(item)
        return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]
