"""Moving fork families between replicas: `POST /v1/sequences/{id}/move` and `POST /v1/replicas/{name}/drain`.

A move is built from the single server's own verbs, so it needs nothing new on a replica:
`GET /v1/sequences` (is any member of the family generating?), `GET /v1/sequences/{id}/export?family=true`
(one archive: tokens and cells, shared cells once), `DELETE /v1/cache/prefixes` on the target (an import
takes only free cells: a pool full of cached prefixes would take the family without its cells),
`POST /v1/sequences/import?new_ids=true` on the target (every sequence gets an id made there, so affinity routes it there) and `DELETE` of the originals,
leaves first. The cells travel in the archive: a moved branch continues with its whole history cached.

Guarantees: a family with a generating member is refused (`409`) before anything changes; if the import
fails, nothing changes; if deleting an original fails (it started generating in between), the
imported copies are deleted again and the move is `409`. An unknown or restarted id is the source
replica's own `404`; an unknown target is `400`, and so is the replica that already holds it.

Drain moves every family off a replica (one move per family root) to the other replicas, fewest
sequences first; the replica stays up and new stateless requests still go to it. (A scale-down moves
families by itself, keeping their ids: `replica.Engine.hand_off`.) Replicas are named by Ray Serve's
replica id, as their ids carry it (`routing`).
"""

import json

from fastapi.responses import JSONResponse, Response

from server.errors import error_body
from server.ray_serve.routing import parse_id


class MoveFailed(Exception):
    """A move that could not be made; `response` is what the client gets (nothing changed)."""

    def __init__(self, response: Response):
        super().__init__(response.status_code)
        self.response = response


def refuse(status: int, message: str, code: str) -> MoveFailed:
    return MoveFailed(JSONResponse(error_body(status, message, code=code), status_code=status))


def known_replica(name: object, replicas: list[str]) -> str:
    """`name` if it is one of the running replicas; a 400 saying which names exist otherwise."""
    if not isinstance(name, str) or name not in replicas:
        raise refuse(400, f"unknown replica {name!r}: name one of {', '.join(replicas)}", "unknown_replica")
    return name


def family_of(seq_id: str, listed: list[dict]) -> list[dict]:
    """The sequences of `seq_id`'s fork family (its root and every descendant) among `listed`."""
    by_id = {s["id"]: s for s in listed}
    root = seq_id
    while by_id.get(root, {}).get("parent") in by_id:
        root = by_id[root]["parent"]
    members, frontier = [by_id[root]] if root in by_id else [], {root}
    while frontier:
        kids = [s for s in listed if s.get("parent") in frontier]
        members += kids
        frontier = {s["id"] for s in kids}
    return members


def roots(listed: list[dict]) -> list[str]:
    """One id per family: the sequences whose parent is not among `listed`, oldest first."""
    ids = {s["id"] for s in listed}
    return [s["id"] for s in sorted(listed, key=lambda s: s["created"]) if s.get("parent") not in ids]


class Mover:
    """Moves families for one request; `send(replica, method, path, query, body)` -> (status, body bytes)
    asks that replica with the client's headers (its API key); `replicas` are the running replicas."""

    def __init__(self, send, replicas: list[str]):
        self.send, self.replicas = send, replicas

    async def _json(self, i: str, method: str, path: str, query: bytes = b"", body: bytes = b"",
                    ok: tuple[int, ...] = (200,)):
        status, content = await self.send(i, method, path, query, body)
        if status not in ok:
            raise MoveFailed(Response(content, status_code=status, media_type="application/json"))
        return json.loads(content) if status == 200 and content else None

    async def listed(self, i: str) -> list[dict]:
        return (await self._json(i, "GET", "/v1/sequences"))["data"]

    async def move(self, seq_id: str, target: str, source: str | None = None) -> dict[str, str]:
        """Move `seq_id`'s family (on `source`, default: the replica its id names) to replica `target`;
        {old id: new id}. Raises MoveFailed."""
        source = source or parse_id(seq_id)
        if source is None or source not in self.replicas:
            raise refuse(404, f"sequence {seq_id} not found (no running replica made this id)", "sequence_not_found")
        if source == target:
            raise refuse(400, f"sequence {seq_id} is already on replica {target}; name another",
                         "same_replica")
        info = await self._json(source, "GET", f"/v1/sequences/{seq_id}")  # a 404 (or restarted) as is
        family = family_of(info["id"], await self.listed(source))
        busy = [s["id"] for s in family if s["status"] != "idle"]
        if busy:
            raise refuse(409, f"sequence {busy[0]} of this family is generating; wait for it or cancel it, then "
                         f"move again", "sequence_busy")
        archive = await self.send(source, "GET", f"/v1/sequences/{seq_id}/export", b"family=true", b"")
        if archive[0] != 200:
            raise MoveFailed(Response(archive[1], status_code=archive[0], media_type="application/json"))
        await self._json(target, "DELETE", "/v1/cache/prefixes")  # an import only takes free cells: make them free
        ids = (await self._json(target, "POST", "/v1/sequences/import", b"new_ids=true", archive[1]))["ids"]
        await self._drop_originals(source, target, ids)
        return ids

    async def _drop_originals(self, source: str, target: str, ids: dict[str, str]) -> None:
        """Delete the originals, leaves first; a refusal undoes the import (the originals stay where they were)."""
        for old in reversed(list(ids)):
            status, content = await self.send(source, "GET", f"/v1/sequences/{old}", b"", b"")
            if status == 200 and json.loads(content)["status"] != "idle":  # it started generating meanwhile
                for new in reversed(list(ids.values())):
                    await self.send(target, "DELETE", f"/v1/sequences/{new}", b"", b"")
                raise refuse(409, f"sequence {old} started generating during the move; nothing was moved",
                             "sequence_busy")
        for old in reversed(list(ids)):
            await self._json(source, "DELETE", f"/v1/sequences/{old}", ok=(200, 404))

    async def drain(self, source: str) -> dict:
        """Move every family off replica `source`, each to the other replica holding fewest sequences;
        families that could not move are listed with why."""
        others = [i for i in self.replicas if i != source]
        if not others:
            raise refuse(400, "there is no other replica to drain to", "no_other_replica")
        held = {i: len(await self.listed(i)) for i in others}
        moved, failed, ids = {}, {}, {}
        listed = await self.listed(source)
        for root in roots(listed):
            target = min(others, key=lambda i: held[i])
            try:
                got = await self.move(root, target, source)
            except MoveFailed as exc:
                failed[root] = json.loads(exc.response.body or b"{}").get("error", {}).get("message", "")
                continue
            held[target] += len(got)
            moved[root] = target
            ids.update(got)
        return {"object": "replica.drained", "replica": source, "ids": ids, "families": moved,
                "not_moved": failed}
