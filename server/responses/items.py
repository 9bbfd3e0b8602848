"""`GET /v1/responses/{id}/input_items`: a stored response's input items in OpenAI's list shape.

Guarantees: every item has an `id` (the one it was sent with, else a new one) and OpenAI's item shape
(`message` with `input_text` parts, or `output_text` for an assistant's; `function_call`,
`function_call_output`, `reasoning`); the list is the items of that response's own `input`, in the
order asked (`order`, newest first by default, as OpenAI), paginated by `after` (an item id: the items
that follow it in that order) and `limit` (1-100, default 20), with `first_id`, `last_id`, `has_more`
as the `openai` SDK's cursor page reads them. A wrong `order`/`limit`/`after` is a 400 naming it.
"""

import uuid

from server.errors import APIError
from server.responses.protocol import FunctionCallItem, FunctionCallOutputItem, MessageItem, ReasoningItem


def _id(given: str | None, prefix: str) -> str:
    return given or f"{prefix}_{uuid.uuid4().hex}"


def item_dict(item) -> dict:
    """One parsed input item as OpenAI returns it from `input_items`."""
    if isinstance(item, MessageItem):
        if item.role == "assistant":
            part = {"type": "output_text", "text": item.content, "annotations": [], "logprobs": []}
        else:
            part = {"type": "input_text", "text": item.content}
        return {"id": _id(item.id, "msg"), "type": "message", "role": item.role, "status": "completed",
                "content": [part]}
    if isinstance(item, FunctionCallItem):
        return {"id": _id(item.id, "fc"), "type": "function_call", "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments, "status": "completed"}
    if isinstance(item, FunctionCallOutputItem):
        return {"id": _id(item.id, "fco"), "type": "function_call_output", "call_id": item.call_id,
                "output": item.output, "status": "completed"}
    assert isinstance(item, ReasoningItem)
    return {"id": _id(item.id, "rs"), "type": "reasoning", "summary": [p.model_dump() for p in item.summary],
            "content": [p.model_dump() for p in item.content] if item.content is not None else None}


def page(items: list[dict], order: str = "desc", after: str | None = None, limit: int = 20) -> dict:
    """One page of `items` (kept oldest first) in OpenAI's list shape."""
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be between 1 and 100, got {limit}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise APIError(400, f"after names no input item of this response ({after!r}); send the id of an item "
                           "from the previous page (its last_id)", param="after")
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(ordered)}
