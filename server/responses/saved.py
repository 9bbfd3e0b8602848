"""ResponseFiles: stored responses on disk (`--state-dir DIR`, one `DIR/responses/<id>.json` each), so
`GET /v1/responses/{id}`, its `input_items` and `previous_response_id` go on after a restart.

A stored response is a prefix of a persistent sequence, and the engine restores that sequence (tokens and
cells) under the same id from the same folder (engine/core/state); this file keeps the rest of a `Stored`:
its sequence id and length, the turn's input and reply messages, the response object, its input items and
how its prompt was rendered (instructions, tools, the template's variables).

Guarantees:
- A file is written whole or not at all (a temporary file, fsynced, renamed over the old one), so a
  `kill -9` at any moment leaves the previous state or the new one.
- A response's history is its parents' turns, so a parent that is evicted or deleted while a stored
  response continues it is kept as a *hidden* record (never listed or retrievable, only read as history)
  and deleted with its last descendant; a parent forgotten before its child was stored is written hidden.
- A file that is not a valid record (torn, foreign, ids not of our shape, its parent missing) is logged and
  skipped, never trusted; a write the disk refuses is logged, and the response lives on in memory.
"""

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from engine.api.files import TMP_SUFFIX, write_atomic
from engine.api.ids import is_valid_id
from server.generation.constraints import Tool
from server.generation.toolcalls import Prompting
from server.responses.store import Stored

log = logging.getLogger("cellserve.server")
VERSION = 1


class BadRecord(ValueError):
    """A response file that cannot be trusted; the message says which field."""


@dataclass
class _OnDisk:
    parent: str | None
    visible: bool  # False: kept only as the history of a later response


class ResponseFiles:
    def __init__(self, root: str | Path):
        self.dir = Path(root) / "responses"
        self.dir.mkdir(parents=True, exist_ok=True)
        for tmp in self.dir.glob(f".*{TMP_SUFFIX}"):  # a write the process did not finish
            tmp.unlink(missing_ok=True)
        self.files: dict[str, _OnDisk] = {}
        self.kids: dict[str, int] = {}  # response id -> files whose parent it is

    # ----- start -------------------------------------------------------------------------------
    def load(self) -> list[Stored]:
        """The stored (visible) responses, least recently saved first, their parents linked; hidden records
        nobody descends from any more are deleted."""
        docs = {}
        for path in sorted(self.dir.glob("*.json")):
            try:
                doc = _checked(json.loads(path.read_bytes()))
                if doc["id"] != path.stem:
                    raise BadRecord(f"its id {doc['id']!r} is not its file name")
            except (OSError, ValueError) as exc:
                log.error("skipping %s: not a valid stored response (%s)", path, exc)
                continue
            docs[doc["id"]] = doc
        made: dict[str, Stored | None] = {}
        for rid in docs:
            self._build(rid, docs, made)
        for rid in list(self.files):
            self._collect(rid)
        live = [rid for rid, f in self.files.items() if f.visible]
        return [made[rid] for rid in sorted(live, key=lambda r: docs[r]["saved"])]

    def _build(self, rid: str, docs: dict, made: dict[str, Stored | None]) -> None:
        """`made[rid]`: the response with its parents linked (built first, walking up iteratively: a chain of
        turns may be long), or None when a parent is missing (its history is lost: skipped, logged)."""
        chain, node = [], rid
        while node is not None and node not in made:
            if node not in docs or node in chain:
                log.error("skipping stored response %s: its parent %s is missing (its history is lost)",
                          chain[-1], node)
                made.update(dict.fromkeys(chain))
                return
            chain.append(node)
            node = docs[node]["parent"]
        parent = made[node] if node is not None else None
        for one in reversed(chain):
            doc = docs[one]
            try:
                parent = _stored(doc, parent) if parent is not None or doc["parent"] is None else None
            except ValueError as exc:  # its tools do not validate
                log.error("skipping stored response %s: %s", one, exc)
                parent = None
            made[one] = parent
            if parent is not None:
                self._note(one, doc["parent"], doc["stored"])

    # ----- changes -----------------------------------------------------------------------------
    def write(self, rec: Stored) -> None:
        """`rec` is stored: its file, and hidden files for any parent not on disk (its history)."""
        chain, node = [], rec.parent
        while node is not None and node.id not in self.files:
            chain.append(node)
            node = node.parent
        try:
            for parent in reversed(chain):
                self._put(parent, visible=False)
            self._put(rec, visible=True)
        except OSError as exc:
            log.error("could not save stored response %s to %s (%s); it is kept in memory only", rec.id, self.dir, exc)

    def drop(self, rec: Stored) -> None:
        """`rec` is no longer stored (deleted, evicted, its sequence gone): its file goes, or is hidden while a
        stored response descends from it."""
        entry = self.files.get(rec.id)
        if entry is None or not entry.visible:
            return
        try:
            if self.kids.get(rec.id):
                self._put(rec, visible=False)
            else:
                self._collect(rec.id, force=True)
        except OSError as exc:
            log.error("could not update the file of stored response %s (%s)", rec.id, exc)

    # ----- internals ---------------------------------------------------------------------------
    def _put(self, rec: Stored, visible: bool) -> None:
        write_atomic(self._path(rec.id), json.dumps(_doc(rec, visible), separators=(",", ":")).encode())
        if rec.id not in self.files:
            self._note(rec.id, rec.parent.id if rec.parent else None, visible)
        self.files[rec.id].visible = visible

    def _note(self, rid: str, parent: str | None, visible: bool) -> None:
        self.files[rid] = _OnDisk(parent, visible)
        if parent is not None:
            self.kids[parent] = self.kids.get(parent, 0) + 1

    def _collect(self, rid: str | None, force: bool = False) -> None:
        """Delete `rid`'s file if it is hidden (or `force`) and nothing descends from it, then its parent's."""
        while rid is not None and (entry := self.files.get(rid)) is not None:
            if self.kids.get(rid) or (entry.visible and not force):
                return
            self._path(rid).unlink(missing_ok=True)
            del self.files[rid]
            force, rid = False, entry.parent
            if rid is not None:
                self.kids[rid] -= 1
                if not self.kids[rid]:
                    del self.kids[rid]

    def _path(self, rid: str) -> Path:
        return self.dir / f"{rid}.json"


def _doc(rec: Stored, visible: bool) -> dict:
    tools = None
    if rec.tools is not None:
        listed = [t.model_dump(mode="json", by_alias=True, exclude_none=True) if isinstance(t, Tool) else t
                  for t in rec.tools.tools]
        tools = {"tools": listed, "generic": rec.tools.generic, "forced": rec.tools.forced}
    return {"v": VERSION, "id": rec.id, "seq_id": rec.seq_id, "length": rec.length,
            "parent": rec.parent.id if rec.parent else None, "stored": visible, "saved": time.time(),
            "instructions": rec.instructions, "tools": tools, "inputs": rec.inputs, "reply": rec.reply,
            "end_token_text": rec.end_token_text, "body": rec.body, "template_kwargs": rec.template_kwargs,
            "input_items": rec.input_items}


def _stored(doc: dict, parent: Stored | None) -> Stored:
    tools = doc["tools"]
    if tools is not None:
        listed = [Tool.model_validate(t) for t in tools["tools"]] if tools["generic"] else tools["tools"]
        tools = Prompting(listed, generic=tools["generic"], forced=tools["forced"])
    return Stored(doc["id"], doc["seq_id"], doc["length"], parent, doc["instructions"], tools, doc["inputs"],
                  doc["reply"], doc["end_token_text"], doc["body"], doc["template_kwargs"], doc["input_items"])


_SHAPES = {"instructions": (str, type(None)), "inputs": list, "reply": dict, "end_token_text": (str, type(None)),
           "body": dict, "template_kwargs": (dict, type(None)), "input_items": list, "stored": bool,
           "saved": (int, float), "tools": (dict, type(None))}


def _checked(doc: object) -> dict:
    """`doc` if it is a version-1 record whose fields have their shapes (ids as the server makes them)."""
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise BadRecord(f"not a version-{VERSION} stored response")
    if not is_valid_id(doc.get("id"), "resp") or not is_valid_id(doc.get("seq_id"), "seq"):
        raise BadRecord("id / seq_id are not a response and a sequence id")
    if doc.get("parent") is not None and not is_valid_id(doc["parent"], "resp"):
        raise BadRecord("parent is not a response id")
    length = doc.get("length")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise BadRecord("length must be a positive integer")
    for name, kind in _SHAPES.items():
        if not isinstance(doc.get(name), kind):
            raise BadRecord(f"{name} has the wrong type")
    tools = doc["tools"]
    if tools is not None and not (isinstance(tools.get("tools"), list) and isinstance(tools.get("generic"), bool)
                                  and isinstance(tools.get("forced"), bool)):
        raise BadRecord("tools must be {tools: [...], generic: bool, forced: bool}")
    if not all(isinstance(m, dict) for m in doc["inputs"] + doc["input_items"]):
        raise BadRecord("inputs and input_items must be lists of objects")
    return doc
