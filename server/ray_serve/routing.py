"""Routing helpers of the scale-out deployment, free of Ray and torch (unit-testable, cheap to import).

- **Affinity**: every id a replica makes carries `r<replica>-` after its kind (`seq-rAb3dE9fG-<hex>`, see
  `engine.api.ids.set_tag`), where `<replica>` is Ray Serve's unique id of that replica (8 letters and
  digits, new at every start of a replica process). A request about an id (its path names it, or a Responses
  request's `previous_response_id` does) goes to that replica, so routing needs no table; a replica that is
  gone (restarted, removed) leaves ids no live replica has: such a request is answered `404` saying so.
  A family moved off a replica before it was removed keeps its ids: its new holder reports them
  (`held`, in its routing stats), and the router sends them there.
- **Prefix**: a replica reports the hashes of the first 256/1024/4096/16384 characters of the prompts it
  served lately (`prefixes` in its routing stats); a request whose prompt starts the same goes to the
  replica with the longest such match unless it is `PREFIX_SLACK` requests busier than the least loaded.
- **Least loaded**: otherwise the replica with the fewest requests (Ray Serve's own queue lengths; the
  replicas' reported running + waiting break ties).
"""

import hashlib
import json
import re
from collections import OrderedDict

ID = re.compile(r"^[a-z]+[-_]r([A-Za-z0-9]{8})-[0-9a-f]{32}$")
ROUTED = re.compile(r"^/v1/(?:sequences|requests|responses)/([^/]+)(?:/[^/]*)?$")
PREFIX_CHARS = (256, 1024, 4096, 16384)
PREFIX_SLACK = 4
PREFIX_ENTRIES = 512  # per replica, reported every routing-stats period: keep the report small


def replica_tag(replica: str) -> str:
    return f"r{replica}-"


def parse_id(some_id: str) -> str | None:
    """The replica (Ray Serve's unique replica id) that made `some_id`; None for any other string."""
    m = ID.match(some_id)
    return m.group(1) if m else None


def parse_replicas(text: str) -> int | tuple[int, int]:
    """`N` (fixed) or `auto:MIN-MAX` (Serve's autoscaling); ValueError saying the forms otherwise."""
    if text.startswith("auto:"):
        low, _, high = text[5:].partition("-")
        if low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high):
            return int(low), int(high)
    elif text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"--replicas {text!r}: give a count (2) or an autoscaling range auto:MIN-MAX (auto:1-4)")


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


class RecentPrefixes:
    """LRU set of hashes of the leading characters of prompts one replica served (what it holds cached)."""

    def __init__(self, entries: int = PREFIX_ENTRIES):
        self.entries = entries
        self._keys: OrderedDict[str, None] = OrderedDict()

    @staticmethod
    def keys(text: str) -> list[str]:
        """Hex hashes of the text's first 256, 1024, ... characters (shortest first; only those it has)."""
        return [hashlib.blake2b(text[:n].encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
                for n in PREFIX_CHARS if len(text) >= n]

    def record(self, text: str) -> None:
        for key in self.keys(text):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.entries:
            self._keys.popitem(last=False)

    def report(self) -> list[str]:
        return list(self._keys)


def longest_match(keys: list[str], reported: dict[str, set[str]]) -> str | None:
    """The replica whose reported prefixes hold the longest of `keys` (shortest first); None if none does."""
    for key in reversed(keys):
        for replica, held in reported.items():
            if key in held:
                return replica
    return None


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
