"""Ids: `<prefix>-<tag><32 hex>` (a uuid4), one scheme for the engine and the server (`<prefix>_...` where a
peer API's ids look so: OpenAI's Responses ids are `resp_...`).

Unguessable, so a client cannot reach another client's sequence or cancel its request by counting;
the prefix says what the id names (`cmpl`, `chatcmpl`, `seq`...). The tag is empty unless the process
set one: a scale-out replica (server/ray_serve) marks every id it makes with itself, so a router can
send later requests on that id back to the replica that holds it.
"""

import re
import uuid

_tag = ""


def set_tag(tag: str) -> None:
    """Put `tag` after the prefix of every id this process makes from now on (one process, one tag)."""
    global _tag
    _tag = tag


def new_id(prefix: str, sep: str = "-") -> str:
    return f"{prefix}{sep}{_tag}{uuid.uuid4().hex}"


_ID_RE = re.compile(r"[a-z]{1,16}[-_][A-Za-z0-9-]{1,128}")


def is_valid_id(text: object, prefix: str) -> bool:
    """Whether `text` has the shape of an id this scheme makes with `prefix` (`seq-<tag><hex>`, or `_` after
    the prefix): letters, digits and dashes only after it, so an id read from a file or an archive can never
    name a path or carry markup."""
    return (isinstance(text, str) and text[len(prefix):len(prefix) + 1] in ("-", "_") and text.startswith(prefix)
            and _ID_RE.fullmatch(text) is not None)
