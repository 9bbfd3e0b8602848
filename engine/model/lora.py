"""LoRA on the native forward: the resident adapters and the segmented low-rank update of one step.

No adapter is merged into the base weights. Every targeted linear runs its base matmul once for all of the
step's rows, then, for each adapter present in the step, `out[rows] += (x[rows] @ A.T) @ (scale * B).T` over
that adapter's rows only (punica / S-LoRA's segmented matmul, here one `index_select`, two `mm` and one
`index_add_` per adapter and fused linear: one loop over the step's adapters, never over rows). The native
forward fuses q|k|v and gate|up into one matmul each; an adapter's A matrices of a fused group are stacked
(`[r_q + r_k + r_v, in]`) and its B matrices laid block-diagonally into the fused output's slices, so a group
costs one update whatever it targets. The scale is folded into B; a request's own scale (llama.cpp's
`lora: [{id, scale}]`) multiplies the `[rows, r]` intermediate. A step of several adapters runs them in one pass
(`Stacked`: their A and B side by side, a mask keeping each row's own columns), which costs a fixed number of ops
per linear instead of four per adapter; steps of a few rows with the fused kernels on run each linear's
updates in one kernel call instead (`KernelStep`, engine/model/lora_kernel.py).

A step without adapter rows runs exactly as before (no hook is called). With adapters on gate|up, the SwiGLU
runs unfused for that step (the update must land before the activation); `down` and `o` add theirs after
the fused residual add, which commutes. A mixture-of-experts MLP takes attention targets only.

`LoraRegistry` holds the resident adapters in least-recently-used order: `max_loras` of them and at most
`max_bytes`; loading one past either unloads the least recently used adapter that no request uses, and
refuses (AdapterMemoryFull) when only adapters in use are left. Loads happen between steps (the engine
thread), so nothing a step reads is unloaded under it.
"""

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.api.lora import AdapterInfo, AdapterMemoryFull, AdapterNotFound, LoraBinding
from engine.loader.adapter_gguf import read_adapter
from engine.loader.adapters import AdapterError, AdapterWeights
from engine.model.lora_kernel import KernelStep
from engine.model.lora_stacked import Stacked
from engine.model.native.layer import DenseMLP

STACKED_SETS = 4  # sets of adapters whose stacked weights stay cached (each a copy of its adapters' bytes)
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}


@dataclass(frozen=True)
class Dims:
    """The base model's shapes an adapter must match: each projection's (in, out) and the layer count."""

    shapes: dict  # projection -> (in_features, out_features)
    n_layers: int
    dense_mlp: tuple[bool, ...]  # per layer: a dense MLP (MLP targets allowed)
    heads: tuple[int, int] = (0, 0)  # (query heads, kv heads)

    @staticmethod
    def of(config, native) -> "Dims":
        cfg = config.get_text_config()
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        q, kv = heads * head_dim, (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim
        h, i = cfg.hidden_size, getattr(cfg, "intermediate_size", 0)
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                  "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return Dims(shapes, len(native.layers), tuple(isinstance(layer.mlp, DenseMLP) for layer in native.layers),
                    (heads, kv // head_dim))


@dataclass
class Group:
    """One fused linear's update: A stacked `[R, in]`, B block-diagonal `[out, R]` with the scale folded in;
    `parts`: per projection of the group, (its output rows of B, end; its columns of B = its rows of A, end)."""

    a: torch.Tensor
    b: torch.Tensor
    parts: tuple = ()


class Adapter:
    """A resident adapter: its groups per layer in the forward's dtype, and what `/v1/models` shows."""

    def __init__(self, uid: int, name: str, weights: AdapterWeights, dims: Dims, dtype: torch.dtype):
        self.uid, self.name = uid, name
        self.layers: list[dict[str, Group]] = [{} for _ in range(dims.n_layers)]
        for i, mods in weights.layers.items():
            _check_layer(weights.path, i, mods, dims)
            for group, names in GROUPS.items():
                if any(n in mods for n in names):
                    self.layers[i][group] = _group(mods, names, dims, dtype)
        nbytes = sum(t.nbytes for layer in self.layers for g in layer.values() for t in (g.a, g.b))
        self.info = AdapterInfo(uid, name, weights.path, weights.rank, weights.alpha, weights.targets, nbytes)

    @property
    def nbytes(self) -> int:
        return self.info.nbytes


def _check_layer(path: str, i: int, mods: dict, dims: Dims) -> None:
    if i >= dims.n_layers:
        raise AdapterError(f"{path}: an update for layer {i}, but the model has {dims.n_layers} layers: "
                           f"the adapter was trained on another base model")
    for name, (a, b, _) in mods.items():
        want = dims.shapes[name]
        if (a.shape[1], b.shape[0]) != want:
            raise AdapterError(f"{path}: layer {i} {name} maps {a.shape[1]} -> {b.shape[0]} features but the "
                               f"model's maps {want[0]} -> {want[1]}: the adapter was trained on another base model")
        if name in GROUPS["gate_up"] + GROUPS["down"] and not dims.dense_mlp[i]:
            raise AdapterError(f"{path}: layer {i} {name}: MLP targets on a mixture-of-experts layer are not "
                               f"served; use an adapter of the attention projections only")


def _group(mods: dict, names: tuple[str, ...], dims: Dims, dtype: torch.dtype) -> Group:
    present = [n for n in names if n in mods]
    a = torch.cat([mods[n][0] for n in present])
    widths = [dims.shapes[n][1] for n in names]
    b = torch.zeros(sum(widths), a.shape[0])
    row, col, parts = 0, 0, []
    for name, width in zip(names, widths):
        rank = 0
        if name in mods:
            _, bn, scale = mods[name]
            rank = bn.shape[1]
            b[row:row + width, col:col + rank] = bn * scale
        parts.append((row, row + width, col, col + rank))
        row, col = row + width, col + rank
    return Group(a.to(dtype).contiguous(), b.to(dtype).contiguous(), tuple(parts))


@dataclass
class Segment:
    """One adapter's rows of a step: `rows` (an index), or `span` (start, stop) when they are contiguous."""

    adapter: Adapter
    rows: torch.Tensor
    span: tuple[int, int] | None
    scale: float


class LayerDeltas:
    """The step's segments for one layer: `add(group, x, out)` returns `out` (the fused linear's output for
    input `x`) with each adapter's update added to its own rows (in place, or a new tensor)."""

    def __init__(self, layer: int, segments: list[Segment], stacked: "Stacked | None" = None):
        self.layer, self.segments, self.stacked = layer, segments, stacked

    def targets(self, group: str) -> bool:
        return any(group in s.adapter.layers[self.layer] for s in self.segments)

    @property
    def kernel(self) -> KernelStep | None:
        return None if self.stacked is None else self.stacked.kernel

    def add(self, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.add(self.layer, group, x, out)
        if self.stacked is not None:
            fused = self.stacked.fused(self.layer, group)
            return out if fused is None else self.stacked.add(fused.b, self.stacked.low(fused, x), out)
        for s in self.segments:
            g = s.adapter.layers[self.layer].get(group)
            if g is None:
                continue
            xs = x[s.span[0]:s.span[1]] if s.span else x.index_select(0, s.rows)
            t = torch.mm(xs, g.a.t())
            if s.scale != 1.0:
                t.mul_(s.scale)
            if s.span:
                out[s.span[0]:s.span[1]].addmm_(t, g.b.t())
            else:
                out.index_add_(0, s.rows, torch.mm(t, g.b.t()))
        return out

    def mlp(self, mlp):
        """The layer's MLP with the adapters' gate/up/down updates (itself when none targets it)."""
        if not (self.targets("gate_up") or self.targets("down")):
            return mlp
        return LoraMLP(mlp, self)


class LoraMLP:
    """A dense MLP with the step's updates: gate and up apart when an adapter targets them (the update lands
    before the activation), `down`'s after its fused residual add."""

    def __init__(self, mlp: DenseMLP, deltas: LayerDeltas):
        self.mlp, self.deltas = mlp, deltas

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        mlp, deltas = self.mlp, self.deltas
        if deltas.targets("gate_up") and deltas.kernel is not None:
            g = deltas.kernel.glu(deltas.layer, h, *self._base_gate_up(h), mlp.act)
            g = g if g.is_contiguous() else g.contiguous()
        elif deltas.targets("gate_up"):
            gate, up = self._gate_up(h)
            gate = F.silu(gate, inplace=True) if mlp.act == "silu" else F.gelu(gate, approximate="tanh")
            g = gate.mul_(up)
        else:
            g = mlp.glu(h)
        out = mlp.down(g) if residual is None else mlp.down.plus(g, residual)
        return deltas.add("down", g, out)

    def _base_gate_up(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The base's gate(h) and up(h) (views of one output where quantized)."""
        mlp = self.mlp
        if mlp.gate_up is not None:  # a quantized [gate; up] linear
            y = mlp.gate_up(h)
            n = y.shape[1] // 2
            return y[:, :n], y[:, n:]
        return mlp.gate(h), mlp.up(h)

    def _gate_up(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate(h) and up(h), each with the adapters' update."""
        deltas = self.deltas
        gate, up = self._base_gate_up(h)
        if self.mlp.gate_up is not None:
            gate, up = gate.contiguous(), up.contiguous()
        stacked = deltas.stacked
        if stacked is None:
            y = deltas.add("gate_up", h, torch.cat([gate, up], 1))
            n = y.shape[1] // 2
            return y[:, :n], y[:, n:]
        fused = stacked.fused(deltas.layer, "gate_up")
        t = stacked.low(fused, h)
        return stacked.add(fused.b, t, gate), stacked.add(fused.b_up, t, up)


class StepLora:
    """The adapters of one step, by layer (what `NativeLlama.forward` takes)."""

    def __init__(self, segments: list[Segment], cache: dict | None = None, kernel: torch.dtype | None = None):
        self.segments = segments
        self.stacked = Stacked(segments, cache, kernel) if cache is not None else None

    def layer(self, i: int) -> LayerDeltas:
        return LayerDeltas(i, self.segments, self.stacked)


def step_rows(bindings: list[LoraBinding | None], lengths: list[int]) -> list[tuple[int, float, torch.Tensor]] | None:
    """Each adapter's rows of a flat step whose chunks (in order, `lengths` rows each) run under `bindings`:
    `[(uid, scale, rows)]`, one entry per (adapter, scale) present; None when every chunk runs on the base."""
    keys = list(dict.fromkeys(b for b in bindings if b is not None))
    if not keys:
        return None
    index = {k: j for j, k in enumerate(keys)}
    per_chunk = torch.tensor([index[b] if b is not None else -1 for b in bindings])
    per_row = torch.repeat_interleave(per_chunk, torch.tensor(lengths))
    return [(k.uid, k.scale, torch.nonzero(per_row == j).flatten()) for j, k in enumerate(keys)]


class LoraRegistry:
    """The resident adapters (least recently used first) and the step's view of them. Module docstring."""

    def __init__(self, dims: Dims, dtype: torch.dtype, max_loras: int = 8, max_bytes: int | None = None):
        if max_loras < 1:
            raise ValueError(f"max_loras={max_loras}: at least 1")
        self.dims, self.dtype, self.max_loras, self.max_bytes = dims, dtype, max_loras, max_bytes
        self.adapters: OrderedDict[str, Adapter] = OrderedDict()
        self._uids = itertools.count()
        self._infos: tuple[AdapterInfo, ...] = ()  # by id, rebuilt on every load/unload: other threads read it
        self.stacking = True  # steps of adapters in one pass per linear (`Stacked`); False: one pass per adapter
        self.kernel = True  # with stacking and the fused kernels on, few-row steps through `lora_update`
        # the stacked weights of the last STACKED_SETS sets of adapters stepped together (most recent last)
        self._stacked: OrderedDict[tuple, dict] = OrderedDict()

    def load(self, name: str, path: str, busy: frozenset[int] = frozenset()) -> tuple[Adapter, list[Adapter]]:
        """Read and hold the adapter at `path` as `name` (replacing a loaded one of that name unless busy);
        returns it and the adapters unloaded to make room. `busy`: uids requests run under (never unloaded)."""
        weights = read_adapter(path, self.dims.heads)
        adapter = Adapter(next(self._uids), name, weights, self.dims, self.dtype)
        old = self.adapters.get(name)
        if old is not None and old.uid in busy:
            raise AdapterMemoryFull(f"adapter {name!r} is in use by running requests: wait for them, or load the "
                                    f"new weights under another name", "lora_name")
        if self.max_bytes is not None and adapter.nbytes > self.max_bytes:
            raise AdapterMemoryFull(f"adapter {name!r} needs {adapter.nbytes} bytes, more than max_lora_memory "
                                    f"({self.max_bytes}): raise --max-lora-memory", "lora_path")
        gone = [old] if old is not None else []
        kept = [a for a in self.adapters.values() if a is not old]  # least recently used first
        limit = self.max_bytes if self.max_bytes is not None else float("inf")
        for victim in [a for a in kept if a.uid not in busy]:
            if len(kept) < self.max_loras and sum(a.nbytes for a in kept) + adapter.nbytes <= limit:
                break
            kept.remove(victim)
            gone.append(victim)
        if len(kept) >= self.max_loras or sum(a.nbytes for a in kept) + adapter.nbytes > limit:
            raise AdapterMemoryFull(f"adapter {name!r} does not fit: the {len(kept)} adapters left loaded "
                                    f"({sum(a.nbytes for a in kept)} bytes; --max-loras {self.max_loras}, "
                                    f"--max-lora-memory {self.max_bytes}) are all in use; retry when requests "
                                    f"finish", "lora_name")
        for victim in gone:  # nothing changed until it is certain to fit
            del self.adapters[victim.name]
        self.adapters[name] = adapter
        self._snapshot()
        return adapter, gone

    def unload(self, name: str) -> Adapter:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise AdapterNotFound(f"no adapter named {name!r} is loaded ({self._names()})", "lora_name")
        self._snapshot()
        return adapter

    def get(self, name: str) -> Adapter | None:
        """The adapter named `name` (now the most recently used), or None."""
        adapter = self.adapters.get(name)
        if adapter is not None:
            self.adapters.move_to_end(name)
        return adapter

    def by_uid(self, uid: int) -> Adapter | None:
        return next((a for a in self.adapters.values() if a.uid == uid), None)

    def step(self, rows: list[tuple[int, float, torch.Tensor]], device, fused: bool = False) -> StepLora:
        """The step's segments from `step_rows`' entries (every uid resident: loads happen between steps);
        `fused`: the forward runs the fused kernels (then so may the updates: `KernelStep`)."""
        segments = []
        for uid, scale, index in rows:
            adapter = self.by_uid(uid)
            if adapter is None:
                raise AdapterNotFound(f"adapter uid {uid} was unloaded before its step ran", "model")
            n = len(index)
            span = (int(index[0]), int(index[0]) + n) if n and int(index[-1]) - int(index[0]) == n - 1 else None
            segments.append(Segment(adapter, index.to(device), span, scale))
        segments.sort(key=lambda s: (s.adapter.uid, s.scale))  # a stable order: the stacked weights stay cached
        if not self.stacking:
            return StepLora(segments)
        kernel = self.dtype if fused and self.kernel else None
        return StepLora(segments, self._stacked_cache(tuple(s.adapter.uid for s in segments)), kernel)

    def _stacked_cache(self, uids: tuple) -> dict:
        """The stacked weights of this set of adapters (filled lazily, per linear), kept for the last
        STACKED_SETS sets: steps alternating between a few sets restack nothing."""
        cache = self._stacked.pop(uids, None)
        self._stacked[uids] = cache = {} if cache is None else cache
        while len(self._stacked) > STACKED_SETS:
            self._stacked.popitem(last=False)
        return cache

    def infos(self) -> list[AdapterInfo]:
        """The loaded adapters by id (safe from any thread: a snapshot)."""
        return list(self._infos)

    def _snapshot(self) -> None:
        self._stacked.clear()
        self._infos = tuple(a.info for a in sorted(self.adapters.values(), key=lambda a: a.uid))

    def _bytes(self) -> int:
        return sum(a.nbytes for a in self.adapters.values())

    def _names(self) -> str:
        return "loaded: " + ", ".join(self.adapters) if self.adapters else "none is loaded"
