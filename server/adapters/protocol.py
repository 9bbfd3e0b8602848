"""The bodies of the LoRA load/unload routes (vLLM's shapes); what names a request's adapter is
server/generation/lora.py."""

from pydantic import Field

from server.schema import StrictModel


class LoadLoraAdapterRequest(StrictModel):
    """vLLM's `POST /v1/load_lora_adapter` body (`load_inplace`: replace an adapter of that name)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False


class UnloadLoraAdapterRequest(StrictModel):
    """vLLM's `POST /v1/unload_lora_adapter` body (its `lora_int_id` is accepted and unused: names are the key)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
