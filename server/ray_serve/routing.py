"""Routing decisions of the scale-out ingress, free of Ray and torch (unit-testable, cheap to import).

- **Affinity**: every id a replica makes carries `r<index>-<boot>-` after its kind (`seq-r1-3f9a2c01-<hex>`,
  see `engine.api.ids.set_tag`); a request about one (its path names it, or a Responses request's
  `previous_response_id` does) goes to that replica. The index says which replica holds the sequence or runs the request, so
  routing needs no table and survives an ingress restart; the boot token (random per replica start)
  lets a restarted replica tell a sequence it never had (`404`, "the replica restarted") from one
  that never existed.
- **Least loaded**: a stateless request goes to the replica with the fewest requests (the larger of
  what this ingress has in flight there and the replica's last reported running + waiting); ties
  rotate. A replica that just failed is skipped for `DOWN_S` unless every replica is down.
- **Prefix**: the replica that last served a request whose first 256/1024/4096/16384 characters are
  the same holds those tokens as a cached prefix (automatic prefix sharing); such a request goes
  there unless that replica is `PREFIX_SLACK` requests busier than the least loaded one.
"""

import hashlib
import json
import re
import time
from collections import OrderedDict

ID = re.compile(r"^[a-z]+[-_]r(\d+)-([0-9a-f]{8})-[0-9a-f]{32}$")
ROUTED = re.compile(r"^/v1/(?:sequences|requests|responses)/([^/]+)(?:/[^/]*)?$")
PREFIX_CHARS = (256, 1024, 4096, 16384)
PREFIX_SLACK = 4
PREFIX_ENTRIES = 4096
DOWN_S = 10.0


def replica_tag(index: int, boot: str) -> str:
    return f"r{index}-{boot}-"


def replica_name(index: int) -> str:
    return f"r{index}"


def parse_id(some_id: str) -> tuple[int, str] | None:
    """(replica index, boot token) of an id a replica made; None for any other string."""
    m = ID.match(some_id)
    return (int(m.group(1)), m.group(2)) if m else None


def routed_id(path: str, body: bytes = b"") -> str | None:
    """The id a request is about: the sequence, request or stored response its path names
    (`/v1/sequences/{id}[/verb]`, `/v1/requests/{id}/cancel`, `/v1/responses/{id}[/input_items]`), or the
    `previous_response_id` of a `POST /v1/responses` (a stored response is a sequence on one replica)."""
    m = ROUTED.match(path)
    if m:
        return m.group(1)
    if path != "/v1/responses" or b"previous_response_id" not in body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    previous = data.get("previous_response_id") if isinstance(data, dict) else None
    return previous if isinstance(previous, str) else None


class LoadBoard:
    """Which replica a stateless request goes to; counts are advisory (no lock: one event loop)."""

    def __init__(self, n: int):
        self.inflight = [0] * n
        self.reported = [0] * n
        self.down_until = [0.0] * n
        self._next = 0

    def load(self, i: int) -> int:
        return max(self.inflight[i], self.reported[i])

    def up(self, i: int) -> bool:
        return time.monotonic() >= self.down_until[i]

    def mark_down(self, i: int) -> None:
        self.down_until[i] = time.monotonic() + DOWN_S

    def mark_up(self, i: int) -> None:
        self.down_until[i] = 0.0

    def least_loaded(self) -> int:
        n = len(self.inflight)
        order = [(self._next + k) % n for k in range(n)]
        live = [i for i in order if self.up(i)] or order
        best = min(live, key=self.load)  # min keeps the first of equals: the rotation breaks ties
        self._next = (best + 1) % n
        return best


class PrefixTable:
    """LRU map from hashes of a prompt's leading characters to the replica that last served them."""

    def __init__(self, entries: int = PREFIX_ENTRIES):
        self.entries = entries
        self._map: OrderedDict[bytes, int] = OrderedDict()

    @staticmethod
    def keys(text: str) -> list[bytes]:
        return [hashlib.blake2b(text[:n].encode("utf-8", "surrogatepass"), digest_size=16).digest()
                for n in PREFIX_CHARS if len(text) >= n]

    def lookup(self, text: str) -> int | None:
        for key in reversed(self.keys(text)):  # longest first
            if key in self._map:
                self._map.move_to_end(key)
                return self._map[key]
        return None

    def record(self, text: str, replica: int) -> None:
        for key in self.keys(text):
            self._map[key] = replica
            self._map.move_to_end(key)
        while len(self._map) > self.entries:
            self._map.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A restarted replica holds no cached prefix any more."""
        for key in [k for k, v in self._map.items() if v == replica]:
            del self._map[key]


def prompt_text(path: str, body: bytes) -> str | None:
    """The text whose prefix identifies a stateless request's prompt (None: not worth routing by)."""
    if path not in ("/v1/completions", "/v1/chat/completions", "/v1/sequences") or len(body) < PREFIX_CHARS[0]:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("messages"), list):
        return json.dumps(data["messages"], sort_keys=True, ensure_ascii=False)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else (json.dumps(prompt) if prompt else None)


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus expositions of several replicas as one, each sample labelled `replica="rN"`.

    Samples of one family stay together under its `# HELP`/`# TYPE` (the text format requires it)."""
    families: OrderedDict[str, tuple[list[str], list[str]]] = OrderedDict()
    for replica, text in texts.items():
        family = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    head = families.setdefault(family, ([], []))[0]
                    if line not in head:
                        head.append(line)
                continue
            cut = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
            name, rest = line[:cut], line[cut:]
            label = f'replica="{replica}"'
            labelled = f"{name}{{{label},{rest[1:]}" if rest.startswith("{") else f"{name}{{{label}}}{rest}"
            families.setdefault(family or name, ([], []))[1].append(labelled)
    out = []
    for head, samples in families.values():
        out.extend(head)
        out.extend(samples)
    return "\n".join(out) + "\n"


def sum_cache(views: dict[str, dict]) -> dict:
    """`/v1/cache` of several replicas: the single server's fields as totals, plus `replicas` (each view)."""
    def add(a: dict, b: dict) -> dict:
        for k, v in b.items():
            if isinstance(v, bool) or k in ("object", "read_len", "cell_bytes"):
                a.setdefault(k, v)
            elif isinstance(v, (int, float)):
                a[k] = a.get(k, 0) + v
            elif isinstance(v, dict):
                a[k] = add(a.get(k, {}), v)
        return a

    total: dict = {"object": "cache"}
    for view in views.values():
        add(total, view)
    total["sequences"] = [dict(s, replica=name) for name, view in views.items() for s in view.get("sequences", [])]
    total["replicas"] = views
    return total
