"""What names a request's LoRA adapter, shared by every API surface, and the adapters' `/v1/models` cards.

Two ways, as the servers people already use do:
- vLLM's: the adapter's name as the request's `model` (any other name is the base model, as before);
- llama.cpp's: `lora: [{"id": 0, "scale": 1.0}]` (ids in load order, `GET /lora-adapters` lists them). An entry
  of scale 0 is the adapter off; one adapter per request (several with non-zero scales: a 400).
`lora_ref` turns either into the engine's `LoraRef` (engine/api/lora.py), which the engine resolves at admission
(an unknown adapter: 404 naming the loaded ones). The load/unload routes are server/adapters/.
"""

from pydantic import Field

from engine.api.lora import MAX_LORA_SCALE, LoraRef
from server.errors import APIError
from server.schema import StrictModel
from server.state import ServerContext


class LoraEntry(StrictModel):
    """One entry of llama.cpp's per-request `lora` list."""

    id: int = Field(ge=0)
    scale: float = Field(1.0, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE)


def lora_ref(model: str | None, entries: list[LoraEntry] | None = None) -> LoraRef | None:
    """The adapter a request names: llama.cpp's `lora` entries when given, else its `model` (vLLM's)."""
    if entries:
        on = [e for e in entries if e.scale != 0.0]
        if len(on) > 1:
            raise APIError(400, f"{len(on)} adapters with non-zero scales: a request runs under one adapter here; "
                           f"send one entry (others with scale 0)", param="lora")
        return LoraRef(id=on[0].id, scale=on[0].scale) if on else None
    return LoraRef(name=model, by_model=True) if model else None


def adapter_card(info) -> dict:
    """An adapter as the load/unload answers and `/v1/models` show it."""
    return {"id": info.id, "name": info.name, "path": info.path, "rank": info.rank, "alpha": info.alpha,
            "target_modules": list(info.targets), "bytes": info.nbytes}


def adapter_cards(ctx: ServerContext, created: int) -> list[dict]:
    """`/v1/models` entries of the loaded adapters (vLLM's shape: `root` the adapter's path, `parent` the base)."""
    engine = ctx.require_engine()
    return [{"id": a.name, "object": "model", "created": created, "owned_by": "cellserve", "root": a.path,
             "parent": ctx.model_name, "max_model_len": engine.max_model_len, "lora": adapter_card(a)}
            for a in engine.lora_adapters()]
