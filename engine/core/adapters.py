"""Adapters: which LoRA adapter each request and sequence runs under, and loading/unloading them between steps.

A request's `SamplingParams.lora` (a `LoraRef`: a name, or llama.cpp's integer id, and a scale) is resolved at
admission to a `LoraBinding` (engine/api/lora.py) that its sequence keeps: the step carries each row's
adapter to the forward (engine/model/lora.py) and the prefix index shares cells only within one binding.
A name given as the request's `model` that no adapter has means the base model (any served name works, as
before); a name or id given explicitly that is not loaded is AdapterNotFound (404).

A persistent sequence keeps its adapter: a continuation that names none runs under it; one that names another
adapter runs under that one from then on, its cells dropped (its tokens recomputed: K/V belong to the weights
that computed them). So does a sequence whose adapter was unloaded and loaded again (a new load is a new
`uid`). Unloading (explicitly, or the registry's least-recently-used rule when a load needs room) never
touches an adapter a request in flight runs under; the cells of sequences under an unloaded adapter are
released (cached prefixes and idle sequences: their tokens stay).
"""

from engine.api.errors import InvalidRequest
from engine.api.lora import AdapterBusy, AdapterInfo, AdapterNotFound, LoraBinding, LoraRef
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.loader.adapters import AdapterError


class Adapters:
    """The engine's side of the LoRA registry (`runner.loras`, None where the model has no native forward)."""

    def __init__(self, registry, scheduler: Scheduler, requests: dict, max_loras: int, max_bytes: int | None):
        self.registry, self.scheduler, self.requests = registry, scheduler, requests
        if registry is not None:
            registry.max_loras, registry.max_bytes = max_loras, max_bytes

    def bind(self, ref: LoraRef | None, seq: Sequence | None = None) -> LoraBinding | None:
        """The binding a request's `ref` asks for; None for the base model, or, continuing `seq` with no
        adapter named, `seq`'s own (re-resolved by name)."""
        if ref is None or (ref.by_model and self._find(ref) is None):
            return self._current(seq.lora) if seq is not None and seq.lora is not None else None
        adapter = self._find(ref)
        if adapter is None:
            what = f"named {ref.name!r}" if ref.name is not None else f"with id {ref.id}"
            raise AdapterNotFound(f"no LoRA adapter {what} is loaded ({self._loaded()}); load it with "
                                  f"POST /v1/load_lora_adapter or --lora NAME=PATH", "lora" if ref.id is not None else "model")
        if not ref.by_model and ref.scale == 0.0:
            return None  # llama.cpp's scale 0: the adapter off
        return LoraBinding(adapter.uid, adapter.name, float(ref.scale))

    def rebind(self, seq: Sequence, lora: LoraBinding | None) -> None:
        """`seq` (not running) continues under `lora`: its cells go if they were computed under another."""
        self.scheduler.rebind(seq, lora)

    def load(self, name: str, path: str, replace: bool = False) -> AdapterInfo:
        """Load `path` as `name` (llama.cpp's next id); an adapter of that name already loaded is replaced only
        with `replace` (vLLM's load_inplace), and never while requests run under it."""
        if self.registry is None:
            raise InvalidRequest("LoRA adapters run on the native forward (Llama, Mistral, Qwen2/3, Gemma 3); this "
                                 "model runs on the transformers modules", "lora_path")
        if not name or not isinstance(name, str):
            raise InvalidRequest("an adapter needs a non-empty name", "lora_name")
        if name in self.registry.adapters and not replace:
            raise InvalidRequest(f"an adapter named {name!r} is already loaded: unload it first, or load with "
                                 f"load_inplace true to replace its weights", "lora_name")
        try:
            adapter, gone = self.registry.load(name, path, self.busy())
        except (AdapterError, OSError) as exc:  # the folder or file: a 400 saying what is wrong with it
            raise InvalidRequest(str(exc), "lora_path") from None
        self._drop_cells({a.uid for a in gone})
        return adapter.info

    def unload(self, name: str) -> AdapterInfo:
        if self.registry is None or name not in self.registry.adapters:
            raise AdapterNotFound(f"no LoRA adapter named {name!r} is loaded ({self._loaded()})", "lora_name")
        uid = self.registry.adapters[name].uid
        if uid in self.busy():
            raise AdapterBusy(f"adapter {name!r} has requests running under it: wait for them or cancel them, "
                              f"then unload", "lora_name")
        adapter = self.registry.unload(name)
        self._drop_cells({uid})
        return adapter.info

    def infos(self) -> list[AdapterInfo]:
        return self.registry.infos() if self.registry is not None else []

    def busy(self) -> frozenset[int]:
        """The uids of adapters that requests in flight run under (never unloaded)."""
        return frozenset(s.lora.uid for req in self.requests.values() for s in req.seqs if s.lora is not None)

    def _find(self, ref: LoraRef):
        if self.registry is None:
            return None
        return self.registry.get(ref.name) if ref.name is not None else self.registry.by_uid(ref.id)

    def _current(self, lora: LoraBinding) -> LoraBinding:
        """`lora` as loaded now (its name may have been reloaded under a new uid); AdapterNotFound if gone."""
        adapter = self.registry.get(lora.name) if self.registry is not None else None
        if adapter is None:
            raise AdapterNotFound(f"this sequence runs under LoRA adapter {lora.name!r}, which is no longer loaded; "
                                  f"load it again (POST /v1/load_lora_adapter)", "model")
        return lora if adapter.uid == lora.uid else LoraBinding(adapter.uid, lora.name, lora.scale)

    def _drop_cells(self, uids: set[int]) -> None:
        """Cells computed under unloaded adapters: released (holders not running; their tokens stay)."""
        if not uids:
            return
        for seq in list(self.scheduler.holders.values()):
            if seq.lora is not None and seq.lora.uid in uids and seq.request is None:
                self.scheduler.release(seq)

    def _loaded(self) -> str:
        names = list(self.registry.adapters) if self.registry is not None else []
        return "loaded: " + ", ".join(names) if names else "none is loaded"
