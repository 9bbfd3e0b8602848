"""The package layering, read from the source: zero import cycles, and every import points down a layer.

Every import counts: module level, inside functions and under TYPE_CHECKING. The layers, lowest first:
engine.api <- engine.cells, engine.sample, engine.loader <- engine.model <- engine.core <- server, with
speculative decoding (engine.spec) beside engine.core: it reads the core's data (SPEC_MAY_IMPORT_FROM_CORE:
sequences and the plan's types, the scheduler's queues only through `Scheduler.queues()`) and hands back drafts and
verified tokens, and the core imports it only where the engine is put together (CORE_MAY_IMPORT_SPEC).
The server holds the engine through engine.api only; the few places that must build or drive the
engine's torch side are named in SERVER_MAY_IMPORT. Nothing but a benchmark (or the CLI that runs one)
imports a benchmark.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# engine layer -> the engine layers it may import (itself always allowed)
ENGINE_LAYERS = {
    "api": set(),
    "cells": {"api"},
    "sample": {"api"},
    "loader": {"api"},
    "model": {"api", "cells", "loader"},
    "core": {"api", "cells", "sample", "loader", "model", "spec"},
    "spec": {"api", "cells", "sample", "loader", "model", "core"},
    "bench": {"api", "cells", "sample", "loader", "model", "core", "spec"},
}
# the core modules that may import engine.spec: the engine, which builds the speculative decoder
CORE_MAY_IMPORT_SPEC = {"engine.core.engine"}
# what engine.spec may read of the core: it never applies a token or a finish itself (the engine's update does),
# and it does not hold the scheduler: who runs and who waits come from `Scheduler.queues()` (plan.Queues)
SPEC_MAY_IMPORT_FROM_CORE = {"engine.core.sequence", "engine.core.plan"}
# server module prefix -> engine modules (beyond engine.api) it may import, and why
SERVER_MAY_IMPORT = {
    "server.config": ("engine.core.async_engine", "engine.loader.source"),  # builds the engine; pull/models
    "server.cli": ("engine.bench.engine",),  # `cellserve bench engine` runs the engine benchmark
    "server.bench": ("engine.bench.machine",),  # one machine description for every benchmark
}


def _modules() -> dict[str, Path]:
    mods = {}
    for top in ("engine", "server"):
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _resolve(name: str, mods: dict) -> str | None:
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                found = _resolve(target, mods)
                if found and found != mod:
                    graph[mod].add(found)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root, children in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(children)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _layer(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if parts[0] == "engine" and len(parts) > 1 else None


def _is_bench(mod: str) -> bool:
    return ".bench" in f".{mod}"


def test_no_import_cycles():
    assert _cycles(import_graph()) == []


def test_engine_layers_point_down():
    bad = []
    for mod, targets in import_graph().items():
        if not mod.startswith("engine."):
            continue
        layer = _layer(mod)
        for target in targets:
            if target.startswith("server"):
                bad.append(f"{mod} -> {target} (the engine never imports the server)")
            elif target.startswith("engine.") and _layer(target) not in ENGINE_LAYERS[layer] | {layer}:
                bad.append(f"{mod} -> {target} ({layer} may import only {sorted(ENGINE_LAYERS[layer])})")
            elif layer == "core" and _layer(target) == "spec" and mod not in CORE_MAY_IMPORT_SPEC:
                bad.append(f"{mod} -> {target} (only {sorted(CORE_MAY_IMPORT_SPEC)} import engine.spec)")
            elif layer == "spec" and _layer(target) == "core" and target not in SPEC_MAY_IMPORT_FROM_CORE:
                bad.append(f"{mod} -> {target} (engine.spec reads only {sorted(SPEC_MAY_IMPORT_FROM_CORE)})")
    assert bad == []


def test_server_imports_only_the_engine_api():
    bad = []
    for mod, targets in import_graph().items():
        if not mod.startswith("server"):
            continue
        allowed = next((v for k, v in SERVER_MAY_IMPORT.items() if mod == k or mod.startswith(k + ".")), ())
        for target in targets:
            if target.startswith("engine") and not target.startswith("engine.api") and target not in allowed:
                bad.append(f"{mod} -> {target}")
    assert bad == []


def test_nothing_but_benchmarks_imports_a_benchmark():
    bad = [f"{mod} -> {target}" for mod, targets in import_graph().items() for target in targets
           if _is_bench(target) and not _is_bench(mod) and mod != "server.cli"]
    assert bad == []


def test_the_checks_see_a_cycle_and_a_layer_break():
    """The checks can fail: a made-up graph with a cycle and an upward import is caught."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "model" not in ENGINE_LAYERS["cells"] and "core" not in ENGINE_LAYERS["model"]


# --- server layers (lowest first): the base modules (server/*.py that build nothing above them) <-
# server.generation (what every API surface shares) <- the surfaces (every other package under server/) <-
# the top (the app that mounts them, the CLI, Ray Serve, benchmarks). A surface imports generation/ and the
# base, never another surface; state.py imports nothing above it; nothing imports a layer above its own.
SERVER_TOP = ("server.app", "server.cli", "server.config", "server.ray_serve", "server.bench")


def _server_rank(mod: str) -> tuple[int, str]:
    """(rank, unit): 0 base, 1 generation, 2 a surface (unit: its package), 3 the top."""
    if any(mod == t or mod.startswith(t + ".") for t in SERVER_TOP):
        return 3, mod
    parts = mod.split(".")
    if len(parts) == 2 and not (ROOT / "server" / parts[1]).is_dir():
        return 0, mod
    if parts[1] == "generation":
        return 1, "server.generation"
    return 2, f"server.{parts[1]}"


def server_layer_breaks(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, targets in graph.items():
        if not mod.startswith("server."):
            continue
        rank, unit = _server_rank(mod)
        for target in targets:
            if not target.startswith("server."):
                continue
            t_rank, t_unit = _server_rank(target)
            if t_rank > rank and rank < 3:
                bad.append(f"{mod} -> {target} (imports a layer above its own)")
            elif rank == t_rank == 2 and unit != t_unit:
                bad.append(f"{mod} -> {target} (a surface imports another: share it in server.generation)")
    return bad


def test_server_layers_point_down():
    assert server_layer_breaks(import_graph()) == []


def test_the_server_check_sees_a_surface_and_an_upward_import():
    graph = {"server.state": {"server.generation.run"}, "server.anthropic.routes": {"server.openai.protocol"},
             "server.openai.routes": {"server.generation.sse"}}
    assert server_layer_breaks(graph) == [
        "server.state -> server.generation.run (imports a layer above its own)",
        "server.anthropic.routes -> server.openai.protocol (a surface imports another: share it in server.generation)"]


def _engine_client_members() -> set[str]:
    tree = ast.parse((ROOT / "engine/api/client.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineClient")
    return {n.target.id if isinstance(n, ast.AnnAssign) else n.name for n in cls.body
            if isinstance(n, ast.AnnAssign | ast.FunctionDef | ast.AsyncFunctionDef)}


def _held_engine_uses(path: Path) -> set[str]:
    """Attributes read off whatever the server holds as its engine: `engine.X`, `ctx.engine.X`, `self.engine.X`."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        held = node.value
        if (isinstance(held, ast.Name) and held.id == "engine") or (isinstance(held, ast.Attribute) and held.attr == "engine"):
            used.add(node.attr)
    return used


def test_the_server_calls_only_what_engine_client_declares():
    """EngineClient is the one front door: every call the server makes on its engine is declared there (and so
    typed against it), and AsyncEngine, the one implementation, has every member it declares."""
    from engine.core.async_engine import AsyncEngine

    declared = _engine_client_members()
    bad = sorted(f"{path.relative_to(ROOT)}: engine.{name}" for path in (ROOT / "server").rglob("*.py")
                 for name in _held_engine_uses(path) - declared)
    assert bad == []
    made = AsyncEngine.__init__.__code__.co_names  # attributes set in __init__ (model_name, n_cells, ...)
    assert sorted(m for m in declared if not hasattr(AsyncEngine, m) and m not in made) == []


def test_async_engine_asks_the_engine_not_its_parts():
    """AsyncEngine drives `Engine` through its methods: no `self.engine.<part>.<member>` (runner, cache, admission,
    scheduler) and no reading a request's sequences."""
    tree = ast.parse((ROOT / "engine/core/async_engine.py").read_text())
    reached = sorted({ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Attribute) and isinstance(n.value.value, ast.Attribute)
                      and n.value.value.attr == "engine" and n.value.attr not in ("config",)}
                     | {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "seqs"})
    assert reached == []


# class -> (the file that defines it, the modules that may assign its fields from outside its own methods):
# one owner (two for a Request: the engine makes it, the output processor reports it; its constructor aside), so a
# field never changes behind its owner's back
FIELD_OWNERS = {
    "Sequence": ("engine/core/sequence.py", {"engine.core.scheduler"}),
    "Choice": ("engine/core/sequence.py", {"engine.core.output_processor"}),
    "Request": ("engine/core/sequence.py", {"engine.core.engine", "engine.core.output_processor"}),
    "RequestMetrics": ("engine/core/sequence.py", {"engine.core.output_processor"}),
    "DraftState": ("engine/spec/state.py", {"engine.spec.decoder", "engine.spec.draft_model"}),
}
# field names other classes use too (a CompletionOutput's finish_reason, error and token_ids, a Request's
# grammar, a stream's detok, a RequestOutput's finished and usage, a FlatStep's lora, a Chunk's seq): checked
# only where the assigned object's name says which class it is
SHARED_NAMES = {"finish_reason", "error", "token_ids", "grammar", "detok", "prompt_logprobs", "finished", "timing",
                "prompt_ids", "cached_tokens", "index", "seq", "request", "params", "tokens", "created", "status", "q",
                "match", "length", "kept", "missed", "expect", "pause", "lora"}


def _fields(path: str, cls: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _assigned_attributes(tree: ast.AST):
    """(object expression, attribute) of every `obj.attr = ...`, `obj.attr += ...`, tuple targets included."""
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign | ast.AnnAssign) else []
        stack = list(targets)
        while stack:
            t = stack.pop()
            if isinstance(t, ast.Tuple | ast.List):
                stack.extend(t.elts)
            elif isinstance(t, ast.Attribute) and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                yield ast.unparse(t.value), t.attr


def _ownership_breaks(modules: dict[str, Path]) -> list[str]:
    bad = []
    for cls, (path, owners) in FIELD_OWNERS.items():
        fields = _fields(path, cls)
        hint = {"Sequence": ("seq", "child", "parent", "holder", "victim"), "Choice": ("choice", "ch", "first"),
                "Request": ("req", "request"), "RequestMetrics": ("metrics", "m"), "DraftState": ("state",)}[cls]
        for mod, file in modules.items():
            if mod in owners or not mod.startswith("engine."):
                continue
            for obj, attr in _assigned_attributes(ast.parse(file.read_text(), str(file))):
                named = obj.split(".")[-1] in hint or obj.endswith((".seq", ".choice"))
                if attr in fields and (attr not in SHARED_NAMES or named):
                    bad.append(f"{mod}: {obj}.{attr} = ... ({cls}.{attr} belongs to {sorted(owners)})")
    return bad


def test_no_module_assigns_another_owners_fields():
    """A Sequence's slot, cells, status and running choice are the scheduler's; a choice's finish the output
    processor's; draft state the speculative decoder's. Any other module asks them (a method) instead."""
    assert _ownership_breaks(_modules()) == []


def test_the_ownership_check_sees_a_foreign_write(tmp_path):
    """The check can fail: a made-up engine module that sets a sequence's cached count is caught."""
    rogue = tmp_path / "rogue.py"
    rogue.write_text("def f(seq, state):\n    seq.n_cached, x = 3, 4\n    state.kept += 1\n")
    assert len(_ownership_breaks({"engine.core.rogue": rogue})) == 2


# class -> (its file, the names its objects go by, the module prefixes that may read its state from outside its own
# methods): the state is what its __init__ sets on self (the scheduler's queues, slots, prefix index, ...); every
# other module asks a method. engine.spec reads who runs and who waits through `Scheduler.queues()` only.
STATE_READERS = {
    "Scheduler": ("engine/core/scheduler.py", ("scheduler", "sched"), ("engine.core.", "engine.bench.")),
}


def _state(path: str, cls: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign | ast.AnnAssign)
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def _state_reads(modules: dict[str, Path]) -> list[str]:
    bad = []
    for cls, (path, names, readers) in STATE_READERS.items():
        state = _state(path, cls)
        for mod, file in modules.items():
            if not mod.startswith("engine.") or (ROOT / path) == file or mod.startswith(readers):
                continue
            for node in ast.walk(ast.parse(file.read_text(), str(file))):
                if not isinstance(node, ast.Attribute) or not (node.attr in state or node.attr.startswith("_")):
                    continue
                held = node.value
                name = held.id if isinstance(held, ast.Name) else held.attr if isinstance(held, ast.Attribute) else ""
                if name in names:
                    bad.append(f"{mod}: {ast.unparse(node)} ({cls}'s state: ask one of its methods)")
    return bad


def test_spec_reads_no_scheduler_state():
    """engine.spec asks `Scheduler.queues()` (handed to the decoder at construction) for who runs and how many
    wait; it never reads the scheduler's lists, slots or prefix index, nor anything private of it."""
    assert _state_reads(_modules()) == []


def test_the_state_check_sees_a_foreign_read(tmp_path):
    """The check can fail: a made-up spec module that reads the scheduler's queues and a private is caught."""
    rogue = tmp_path / "rogue.py"
    rogue.write_text("def f(self, sched):\n    return self.scheduler.running, sched.waiting, sched._free_slots\n")
    assert len(_state_reads({"engine.spec.rogue": rogue})) == 3
    assert _state_reads({"engine.core.rogue": rogue}) == []
