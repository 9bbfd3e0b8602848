"""LoRA adapter routes: vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`, llama.cpp's
`GET /lora-adapters`, and the adapters' gauges in `/metrics` (their `/v1/models` cards: server/generation/lora.py).

Behind `--api-key` like every route but /health and /metrics. Loading and unloading run on the engine's loop
between two steps (engine/core/adapters.py): a request in flight never loses its adapter (unloading it is a
409), and an adapter that does not fit `--max-loras` / `--max-lora-memory` beside those in use is a 507
naming the limits, nothing unloaded.
"""

from collections.abc import Iterator

from fastapi import APIRouter, Request
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from server.adapters.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from server.errors import APIError
from server.generation.lora import adapter_card
from server.state import ServerContext

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> dict:
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    if body.lora_name == ctx.model_name:
        raise APIError(400, f"{body.lora_name!r} is the base model's name; give the adapter another name",
                       param="lora_name")
    info = await engine.load_lora(body.lora_name, body.lora_path, body.load_inplace)
    return {"object": "lora_adapter", "message": f"LoRA adapter {info.name!r} loaded", **adapter_card(info)}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> dict:
    engine = ServerContext.of(request).require_engine()
    info = await engine.unload_lora(body.lora_name)
    return {"object": "lora_adapter", "message": f"LoRA adapter {info.name!r} unloaded", **adapter_card(info)}


@router.get("/lora-adapters")
async def lora_adapters(request: Request) -> list[dict]:
    """llama.cpp's list: `[{id, path, scale}]` (the scale a request gets when its `lora` entry names none)."""
    engine = ServerContext.of(request).require_engine()
    return [{"id": a.id, "path": a.path, "scale": 1.0, "name": a.name, "bytes": a.nbytes}
            for a in engine.lora_adapters()]


class AdapterCollector(Collector):
    """`cellserve:lora_adapter_bytes{adapter}`: each loaded adapter's bytes, read at scrape time."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ready = self.ctx.engine is not None and self.ctx.state != "loading"
        engine = self.ctx.engine if ready else None
        family = GaugeMetricFamily("cellserve:lora_adapter_bytes", "Bytes each loaded LoRA adapter holds.",
                                   labels=["adapter"])
        for a in engine.lora_adapters() if engine is not None else ():
            family.add_metric([a.name], a.nbytes)
        yield family
